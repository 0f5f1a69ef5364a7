// Type-erased reduction kernels. Data movement lives in the algorithms; arithmetic lives here.
#pragma once
#include <cstddef>

#include "core/types.h"

namespace plait {

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], combined strictly left to right so
// that every rank that reduces the same operands in the same order gets bitwise the same result.
// nsrc >= 1 (nsrc == 1 is a copy). dst may be exactly any source (never a partial overlap). Half types
// (f16, bf16) accumulate in float32 and round once per call.
// op == avg reduces as sum; when avg_divisor > 0 the result is divided by it before it is stored
// (the final step of an average). For every other op avg_divisor is ignored.
// bool: sum and max are logical or, prod and min logical and. Integer sums wrap (two's complement).
void reduce(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc, size_t count,
            int avg_divisor);

// Which instruction set the kernels dispatched to at run time: "avx512", "avx2" or "portable".
const char* reduce_isa();

}  // namespace plait
