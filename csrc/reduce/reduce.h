// Type-erased reduction kernels. Data movement lives in the algorithms; arithmetic lives here.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/types.h"

namespace plait {

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], combined strictly left to right so
// that every rank that reduces the same operands in the same order gets bitwise the same result.
// nsrc >= 1 (nsrc == 1 is a copy). dst may be exactly any source (never a partial overlap). Half
// types (f16, bf16) accumulate in float32 and round once per call. op == avg reduces as sum; when
// avg_divisor > 0 the result is divided by it before it is stored (the final step of an average).
// For every other op avg_divisor is ignored. bool: sum and max are logical or, prod and min logical
// and. Integer sums wrap (two's complement).
//
// Partials: multi-hop algorithms (ring, tree) pass intermediate results between ranks, and for
// the half types those travel as float32 ("partials", partial_size() bytes an element) so that
// the result is rounded once, at the step that finishes it, as in a single-step reduction. Bit j
// of `partial_srcs` (j < 32) says srcs[j] holds partials, `partial_dst` that dst gets them; for
// every other dtype a partial is an element and the flags change nothing. dst and a source in the
// other form must not overlap at all.
void reduce(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc, size_t count,
            int avg_divisor, uint32_t partial_srcs = 0, bool partial_dst = false);

// Bytes of one partial of dtype: 4 (float32) for f16 and bf16, else dtype_size(dtype).
size_t partial_size(DType dtype);

// Which instruction set the kernels dispatched to at run time: "avx512", "avx2" or "portable".
const char* reduce_isa();

}  // namespace plait
