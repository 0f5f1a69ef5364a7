// Type-erased CUDA reduction kernels: the GPU twin of reduce.h, with the same semantics per
// element (bool: sum/max = or, prod/min = and; integer sums/products wrap; NaN propagates through
// min/max; f16/bf16 are widened to float32 and rounded once per call; avg divides the sum).
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "core/types.h"

namespace plait {

// Sources one kernel reduces at most: more than the GPUs one host holds.
constexpr int kMaxReduceSrcs = 32;

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc - 1][i] on `stream`, asynchronously, with
// reduce.h's semantics bit for bit (reduce/reduce_elem.h is the arithmetic): f16/bf16 accumulate
// in float32 over all nsrc sources and round once; for op == avg the finished sum is divided by
// avg_divisor (> 0; 0 leaves it a plain sum, as a step that does not finish the average). dst may
// equal any source exactly. Vectorised (16-, 8- or 4-byte loads) whenever dst and every source
// share their alignment modulo the vector size, after a scalar head up to it. 1 <= nsrc <=
// kMaxReduceSrcs. skip (device memory, may be null): when non-zero the kernel does nothing (an
// IPC wait of this call gave up). Partials as in reduce.h: bit j of partial_srcs says srcs[j]
// holds float32 partials (f16/bf16 only; for other dtypes a partial is an element), partial_dst
// that dst gets them unrounded; such calls run element by element. Throws InvalidArgument for bad
// arguments, PlaitError when the launch fails.
void reduce_many_cuda(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
                      size_t count, int avg_divisor, const int* skip, cudaStream_t stream,
                      uint32_t partial_srcs = 0, bool partial_dst = false);

// reduce_many_cuda over the two sources a and b.
void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 int avg_divisor, const int* skip, cudaStream_t stream, uint32_t partial_srcs = 0,
                 bool partial_dst = false);

// `rows` rows of `width` bytes, from src (rows `spitch` apart) to dst (`dpitch` apart), by a
// kernel (no pitch limit, unlike cudaMemcpy2DAsync's 2^31) that does nothing when *skip is set.
void copy_cuda(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
               const int* skip, cudaStream_t stream);

}  // namespace plait
