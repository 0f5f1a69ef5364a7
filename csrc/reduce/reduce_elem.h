// The reduction kernels' arithmetic per element (reduce_cuda.cu), as __host__ __device__ code so
// that host tests compile it with g++ and compare it bitwise with the CPU kernels
// (tests/gpu_host/test_elem.cc): f16/bf16 widen to float32 and round once per step, integers wrap
// through their unsigned type, NaN propagates through min/max, bool is or/and, and avg divides the
// raw operands in the wide type (NCCL's pre-scaled avg). Needs cuda_fp16.h/cuda_bf16.h, whose
// conversions are host-callable too.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "reduce/reduce_cuda.h"  // AvgScale

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

template <class T, class Op>
PLAIT_HD T apply(T x, T y, AvgScale s) {
  using A = typename Acc<T>::type;
  A u = widen(x), v = widen(y);
  if constexpr (std::is_floating_point<A>::value) {
    if (s.a) u = u / A(s.divisor);  // true divisions: each rounds once, in the wide type
    if (s.b) v = v / A(s.divisor);
  }
  return narrow<T>(Op::f(u, v));
}

}  // namespace elem
}  // namespace plait
