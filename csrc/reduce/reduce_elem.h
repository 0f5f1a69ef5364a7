// The reduction kernels' arithmetic per element (reduce_cuda.cu), as __host__ __device__ code so
// that host tests compile it with g++ and compare it bitwise with the CPU kernels
// (tests/gpu_host/test_elem.cc). The semantics are reduce.h's, step for step: every source is
// widened to the accumulator type (float32 for f16/bf16: the partials of an n-input reduction stay
// float32 and are rounded once, at the store), combined strictly left to right, integers wrap
// through their unsigned type, NaN propagates through min/max, bool is or/and, and avg sums, then
// divides the finished sum by the rank count (a true division in the accumulator type) before the
// one rounding. Needs cuda_fp16.h/cuda_bf16.h, whose conversions are host-callable too.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include <cstdint>

#if defined(__CUDACC__)
#define PLAIT_HD __host__ __device__ __forceinline__
#else
#define PLAIT_HD inline
#endif

namespace plait {
namespace elem {

template <class T>
struct Acc {
  using type = T;
};
template <>
struct Acc<__half> {
  using type = float;
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
};

template <class T>
using AccT = typename Acc<T>::type;

template <class T>
PLAIT_HD typename Acc<T>::type widen(T x) {
  return x;
}
template <>
PLAIT_HD float widen<__half>(__half x) {
  return __half2float(x);
}
template <>
PLAIT_HD float widen<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
PLAIT_HD T narrow(typename Acc<T>::type x) {
  return x;
}
template <>
PLAIT_HD __half narrow<__half>(float x) {
  return __float2half_rn(x);
}
template <>
PLAIT_HD __nv_bfloat16 narrow<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Integer arithmetic in the unsigned type of the same width, so overflow wraps as numpy's does.
template <class A>
using Wrap = typename std::conditional<std::is_integral<A>::value, std::make_unsigned<A>,
                                       std::common_type<A>>::type::type;

struct Sum {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    return A(Wrap<A>(a) + Wrap<A>(b));
  }
};
struct Prod {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    return A(Wrap<A>(a) * Wrap<A>(b));
  }
};
struct Min {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    const A m = a < b ? a : b;
    return a != a ? a : m;  // NaN in a or b propagates, as on the CPU
  }
};
struct Max {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    const A m = a > b ? a : b;
    return a != a ? a : m;
  }
};
struct Or {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    return A((a != 0) | (b != 0));
  }
};
struct And {
  template <class A>
  PLAIT_HD static A f(A a, A b) {
    return A((a != 0) & (b != 0));
  }
};

// A source is read as elements (T) or, where bit j of `partial_srcs` is set, as partials: the
// accumulator values a previous step stored unrounded (reduce.h's partial_srcs; for types whose
// accumulator is the element itself the two forms are the same).
template <class T>
PLAIT_HD AccT<T> load(const void* src, bool partial, int64_t i) {
  return partial ? static_cast<const AccT<T>*>(src)[i] : widen(static_cast<const T*>(src)[i]);
}

// The step that finishes an average: the sum divided by `divisor` (> 0; 0 leaves it alone) in the
// accumulator type. A true division, not a multiply by 1/divisor, which would round twice.
template <class T>
PLAIT_HD AccT<T> divide(AccT<T> acc, int divisor) {
  if constexpr (std::is_floating_point<AccT<T>>::value) {
    if (divisor > 0) acc = acc / AccT<T>(divisor);
  }
  return acc;
}

// dst[i] = srcs[0][i] op ... op srcs[nsrc - 1][i] at one index, as reduce() computes it.
template <class T, class Op>
PLAIT_HD AccT<T> reduce_at(const void* const* srcs, int nsrc, uint32_t partial_srcs, int64_t i,
                           int divisor) {
  AccT<T> acc = load<T>(srcs[0], (partial_srcs & 1u) != 0, i);
  for (int j = 1; j < nsrc; ++j)
    acc = Op::f(acc, load<T>(srcs[j], j < 32 && ((partial_srcs >> j) & 1u) != 0, i));
  return divide<T>(acc, divisor);
}

// Two elements: x op y, divided by `divisor` when it finishes an average, rounded once.
template <class T, class Op>
PLAIT_HD T apply(T x, T y, int divisor) {
  return narrow<T>(divide<T>(Op::f(widen(x), widen(y)), divisor));
}

}  // namespace elem
}  // namespace plait
