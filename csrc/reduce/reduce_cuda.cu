// CUDA reduction kernels. One grid-stride kernel per (element type, operator): the body handles
// 16-byte vectors (8 halves, 4 floats, 16 bytes ...) and a scalar tail. Launch bounds were not
// tuned on a GPU yet (none was available): 256 threads, at most 4 waves of 132 SMs' blocks.
#include "reduce/reduce_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "core/errors.h"

namespace plait {
namespace {

template <class T> struct Acc { using type = T; };
template <> struct Acc<__half> { using type = float; };
template <> struct Acc<__nv_bfloat16> { using type = float; };

template <class T> __device__ __forceinline__ typename Acc<T>::type widen(T x) { return x; }
template <> __device__ __forceinline__ float widen<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <class T> __device__ __forceinline__ T narrow(typename Acc<T>::type x) { return x; }
template <> __device__ __forceinline__ __half narrow<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Integer arithmetic in the unsigned type of the same width, so overflow wraps as numpy's does.
template <class A>
using Wrap = typename std::conditional<std::is_integral<A>::value, std::make_unsigned<A>, std::common_type<A>>::type::type;

struct Sum {
  template <class A> __device__ static A f(A a, A b) { return A(Wrap<A>(a) + Wrap<A>(b)); }
};
struct Prod {
  template <class A> __device__ static A f(A a, A b) { return A(Wrap<A>(a) * Wrap<A>(b)); }
};
struct Min {
  template <class A> __device__ static A f(A a, A b) {
    const A m = a < b ? a : b;
    return a != a ? a : m;  // NaN in a or b propagates, as on the CPU
  }
};
struct Max {
  template <class A> __device__ static A f(A a, A b) {
    const A m = a > b ? a : b;
    return a != a ? a : m;
  }
};
struct Or {
  template <class A> __device__ static A f(A a, A b) { return A((a != 0) | (b != 0)); }
};
struct And {
  template <class A> __device__ static A f(A a, A b) { return A((a != 0) & (b != 0)); }
};

template <class T, class Op>
__device__ __forceinline__ T apply(T x, T y, int divisor) {
  using A = typename Acc<T>::type;
  A r = Op::f(widen(x), widen(y));
  if constexpr (std::is_floating_point<A>::value) {
    if (divisor > 0) r = r / A(divisor);  // a true division: rounds once, like the CPU kernel
  }
  return narrow<T>(r);
}

template <class T, class Op>
__global__ void reduce_kernel(T* __restrict__ dst, const T* a, const T* b, int64_t n, int64_t nvec,
                              int divisor) {
  constexpr int V = 16 / sizeof(T);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v = first; v < nvec; v += stride) {
    alignas(16) T x[V], y[V], z[V];
    *reinterpret_cast<uint4*>(x) = reinterpret_cast<const uint4*>(a)[v];
    *reinterpret_cast<uint4*>(y) = reinterpret_cast<const uint4*>(b)[v];
#pragma unroll
    for (int k = 0; k < V; ++k) z[k] = apply<T, Op>(x[k], y[k], divisor);
    reinterpret_cast<uint4*>(dst)[v] = *reinterpret_cast<const uint4*>(z);
  }
  for (int64_t i = nvec * V + first; i < n; i += stride) dst[i] = apply<T, Op>(a[i], b[i], divisor);
}

template <class T>
__global__ void divide_kernel(T* dst, const T* src, int64_t n, int divisor) {
  using A = typename Acc<T>::type;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = narrow<T>(widen(src[i]) / A(divisor));
}

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 4 * 132 * 4;

unsigned blocks_for(int64_t work) {
  const int64_t b = (work + kThreads - 1) / kThreads;
  return unsigned(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

void check_launch(const char* what, DType dtype, size_t count) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw PlaitError(std::string(what) + " kernel launch failed (dtype " + dtype_name(dtype) + ", count " +
                     std::to_string(count) + "): " + cudaGetErrorString(e));
}

template <class T, class Op>
void launch(void* dst, const void* a, const void* b, size_t count, int divisor, cudaStream_t s) {
  constexpr int V = 16 / sizeof(T);
  const bool aligned = ((uintptr_t(dst) | uintptr_t(a) | uintptr_t(b)) & 15) == 0;
  const int64_t n = int64_t(count), nvec = aligned ? n / V : 0;
  reduce_kernel<T, Op><<<blocks_for(nvec ? nvec : n), kThreads, 0, s>>>(
      static_cast<T*>(dst), static_cast<const T*>(a), static_cast<const T*>(b), n, nvec, divisor);
}

template <class T>
void by_op(RedOp op, void* dst, const void* a, const void* b, size_t n, int d, cudaStream_t s) {
  switch (op) {
    case RedOp::sum:
    case RedOp::avg: return launch<T, Sum>(dst, a, b, n, d, s);
    case RedOp::prod: return launch<T, Prod>(dst, a, b, n, d, s);
    case RedOp::min: return launch<T, Min>(dst, a, b, n, d, s);
    case RedOp::max: return launch<T, Max>(dst, a, b, n, d, s);
    case RedOp::kCount: break;
  }
  throw InvalidArgument("reduce_cuda: bad op code " + std::to_string(int(op)));
}

}  // namespace

void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 int avg_divisor, cudaStream_t s) {
  if (count == 0) return;
  if (op == RedOp::avg && !is_float(dtype))
    throw InvalidArgument(std::string("reduce_cuda: avg needs a floating-point dtype, got ") + dtype_name(dtype));
  const int d = op == RedOp::avg ? avg_divisor : 0;
  switch (dtype) {
    case DType::f16: by_op<__half>(op, dst, a, b, count, d, s); break;
    case DType::bf16: by_op<__nv_bfloat16>(op, dst, a, b, count, d, s); break;
    case DType::f32: by_op<float>(op, dst, a, b, count, d, s); break;
    case DType::f64: by_op<double>(op, dst, a, b, count, d, s); break;
    case DType::i8: by_op<int8_t>(op, dst, a, b, count, d, s); break;
    case DType::u8: by_op<uint8_t>(op, dst, a, b, count, d, s); break;
    case DType::i32: by_op<int32_t>(op, dst, a, b, count, d, s); break;
    case DType::i64: by_op<int64_t>(op, dst, a, b, count, d, s); break;
    case DType::boolean:
      if (op == RedOp::sum || op == RedOp::max) launch<uint8_t, Or>(dst, a, b, count, 0, s);
      else launch<uint8_t, And>(dst, a, b, count, 0, s);
      break;
    case DType::kCount: throw InvalidArgument("reduce_cuda: bad dtype code");
  }
  check_launch("reduce", dtype, count);
}

void divide_cuda(DType dtype, void* dst, const void* src, size_t count, int divisor, cudaStream_t s) {
  if (count == 0) return;
  const int64_t n = int64_t(count);
  switch (dtype) {
    case DType::f16: divide_kernel<__half><<<blocks_for(n), kThreads, 0, s>>>(static_cast<__half*>(dst), static_cast<const __half*>(src), n, divisor); break;
    case DType::bf16: divide_kernel<__nv_bfloat16><<<blocks_for(n), kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(dst), static_cast<const __nv_bfloat16*>(src), n, divisor); break;
    case DType::f32: divide_kernel<float><<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), static_cast<const float*>(src), n, divisor); break;
    case DType::f64: divide_kernel<double><<<blocks_for(n), kThreads, 0, s>>>(static_cast<double*>(dst), static_cast<const double*>(src), n, divisor); break;
    default: throw InvalidArgument(std::string("divide_cuda: needs a floating-point dtype, got ") + dtype_name(dtype));
  }
  check_launch("divide", dtype, count);
}

}  // namespace plait
