// Type-erased CUDA reduction kernels: the GPU twin of reduce.h, with the same semantics per
// element (bool: sum/max = or, prod/min = and; integer sums/products wrap; NaN propagates through
// min/max; f16/bf16 accumulate in float32 and round once per call).
#pragma once
#include <cstddef>

#include <cuda_runtime_api.h>

#include "core/types.h"

namespace plait {

// dst[i] = a[i] op b[i] on `stream`, asynchronously. dst may equal a or b exactly. op == avg
// reduces as sum and divides by avg_divisor when it is > 0 (the step that produces the final
// value). 16-byte vector loads are used when dst, a and b are all 16-byte aligned.
// Throws PlaitError when the launch fails.
void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 int avg_divisor, cudaStream_t stream);

// dst[i] = src[i] / divisor (avg over a world of one, or after a copy): float dtypes only.
void divide_cuda(DType dtype, void* dst, const void* src, size_t count, int divisor, cudaStream_t stream);

}  // namespace plait
