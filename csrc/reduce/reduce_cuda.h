// Type-erased CUDA reduction kernels: the GPU twin of reduce.h, with the same semantics per
// element (bool: sum/max = or, prod/min = and; integer sums/products wrap; NaN propagates through
// min/max; f16/bf16 are widened to float32 for each step and rounded once per step).
#pragma once
#include <cstddef>

#include <cuda_runtime_api.h>

#include "core/types.h"

namespace plait {

// avg over `divisor` ranks, as NCCL lowers ncclAvg (PreMulSum): every contribution is divided by
// the rank count where it first enters a sum, so no partial sum exceeds the range of the largest
// input (a plain sum of 8 fp16 gradients near 1e4 would overflow to inf; NCCL's would not).
// a / b: whether that operand is a rank's raw input (divided) or a partial (already divided).
struct AvgScale {
  int divisor = 0;
  bool a = false, b = false;
};

// dst[i] = a[i] op b[i] on `stream`, asynchronously. dst may equal a or b exactly. op == avg sums
// with the operands `scale` marks divided first. Vectorised (16-, 8- or 4-byte loads) whenever
// dst, a and b share their alignment modulo the vector size, after a scalar head up to it.
// skip (device memory, may be null): when non-zero the kernel does nothing (an IPC wait of this
// call gave up). Throws PlaitError when the launch fails.
void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 AvgScale scale, const int* skip, cudaStream_t stream);

// dst[i] = src[i] / divisor (avg's scaled load, or a world of one): float dtypes only.
void divide_cuda(DType dtype, void* dst, const void* src, size_t count, int divisor,
                 const int* skip, cudaStream_t stream);

// `rows` rows of `width` bytes, from src (rows `spitch` apart) to dst (`dpitch` apart), by a
// kernel (no pitch limit, unlike cudaMemcpy2DAsync's 2^31) that does nothing when *skip is set.
void copy_cuda(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
               const int* skip, cudaStream_t stream);

}  // namespace plait
