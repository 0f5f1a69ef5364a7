// CUDA reduction kernels. One grid-stride kernel per (element type, operator, vector width) over
// up to kMaxReduceSrcs sources: a scalar head up to alignment, vectors of 16 bytes (8 halves, 4
// floats, ...; 8 or 4 bytes when the pointers are misaligned against each other) and a scalar
// tail. Each thread reads every source of its elements into accumulators (float32 for the halves)
// before it stores, so the result is rounded once and dst may be any source. Launch bounds were not
// tuned on a GPU yet (none was available): 256 threads, at most 4 waves of 132 SMs' blocks.
#include "reduce/reduce_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/errors.h"
#include "reduce/reduce_elem.h"

namespace plait {
namespace {

using namespace elem;  // the arithmetic per element, shared with host tests

__device__ __forceinline__ bool skipped(const int* skip) {
  return skip != nullptr && *static_cast<const volatile int*>(skip) != 0;
}

template <int B>
struct Word;
template <>
struct Word<16> {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = uint32_t;
};
template <>
struct Word<2> {
  using type = uint16_t;
};
template <>
struct Word<1> {
  using type = uint8_t;
};

// The sources travel by value in the kernel's parameters: no device copy to allocate or order.
struct Srcs {
  const void* p[kMaxReduceSrcs];
};

// Elements [0, head) one by one (dst is B-aligned after them, and so is every source), then nvec
// vectors of B bytes, then the tail one by one. dst is not __restrict__: in place (dst == a
// source) is used on purpose, and the non-coherent load path that a false promise allows is not
// wanted.
template <class T, class Op, int B>
__global__ void reduce_kernel(T* dst, Srcs s, int nsrc, int64_t head, int64_t nvec, int64_t n,
                              int divisor, const int* skip) {
  if (skipped(skip)) return;
  constexpr int V = B / int(sizeof(T));
  using W = typename Word<B>::type;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = first; i < head; i += stride)
    dst[i] = narrow<T>(reduce_at<T, Op>(s.p, nsrc, 0, i, divisor));
  W* dv = reinterpret_cast<W*>(dst + head);
  for (int64_t v = first; v < nvec; v += stride) {
    alignas(B) T x[V];
    AccT<T> acc[V];
    *reinterpret_cast<W*>(x) = reinterpret_cast<const W*>(static_cast<const T*>(s.p[0]) + head)[v];
#pragma unroll
    for (int k = 0; k < V; ++k) acc[k] = widen(x[k]);
    for (int j = 1; j < nsrc; ++j) {
      *reinterpret_cast<W*>(x) =
          reinterpret_cast<const W*>(static_cast<const T*>(s.p[j]) + head)[v];
#pragma unroll
      for (int k = 0; k < V; ++k) acc[k] = Op::f(acc[k], widen(x[k]));
    }
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = narrow<T>(divide<T>(acc[k], divisor));
    dv[v] = *reinterpret_cast<const W*>(x);
  }
  for (int64_t i = head + nvec * V + first; i < n; i += stride)
    dst[i] = narrow<T>(reduce_at<T, Op>(s.p, nsrc, 0, i, divisor));
}

// With float32 partials among the sources or as the result (f16/bf16 only): element by element.
template <class T, class Op>
__global__ void reduce_partials_kernel(void* dst, Srcs s, int nsrc, uint32_t partial_srcs,
                                       bool partial_dst, int64_t n, int divisor, const int* skip) {
  if (skipped(skip)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const AccT<T> acc = reduce_at<T, Op>(s.p, nsrc, partial_srcs, i, divisor);
    if (partial_dst)
      static_cast<AccT<T>*>(dst)[i] = acc;
    else
      static_cast<T*>(dst)[i] = narrow<T>(acc);
  }
}

template <int B>
__global__ void copy_kernel(char* dst, size_t dpitch, const char* src, size_t spitch,
                            int64_t per_row, int64_t total, const int* skip) {
  using W = typename Word<B>::type;
  if (skipped(skip)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t r = per_row == total ? 0 : i / per_row, k = i - r * per_row;
    reinterpret_cast<W*>(dst + size_t(r) * dpitch)[k] =
        reinterpret_cast<const W*>(src + size_t(r) * spitch)[k];
  }
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
    throw PlaitError(std::string(what) + " kernel launch failed (dtype " + dtype_name(dtype) +
                     ", count " + std::to_string(count) + "): " + cudaGetErrorString(e));
}

// Vectors of B bytes when dst and every source are equally misaligned modulo B (a scalar head
// brings all of them to alignment at once); false when they are not.
template <class T, class Op, int B>
bool launch_vec(T* dst, const Srcs& src, int nsrc, int64_t n, int divisor, const int* skip,
                cudaStream_t s) {
  if constexpr (B <= int(sizeof(T))) {
    return false;
  } else {
    const uintptr_t d = uintptr_t(dst);
    if (d % sizeof(T) != 0) return false;
    for (int j = 0; j < nsrc; ++j)
      if ((d - uintptr_t(src.p[j])) % B != 0) return false;
    constexpr int V = B / int(sizeof(T));
    const int64_t head = std::min<int64_t>(n, int64_t((B - d % B) % B / sizeof(T)));
    const int64_t nvec = (n - head) / V;
    reduce_kernel<T, Op, B><<<blocks_for(nvec + (n - nvec * V)), kThreads, 0, s>>>(
        dst, src, nsrc, head, nvec, n, divisor, skip);
    return true;
  }
}

// Which sources hold partials, and whether dst gets them.
struct Forms {
  uint32_t srcs;
  bool dst;
};

template <class T, class Op>
void launch(void* dst, const Srcs& src, int nsrc, size_t count, int divisor, const int* skip,
            cudaStream_t s, Forms f = {}) {
  T* d = static_cast<T*>(dst);
  const int64_t n = int64_t(count);
  if constexpr (sizeof(AccT<T>) != sizeof(T)) {
    if (f.dst || (f.srcs & ((nsrc < 32 ? 1u << nsrc : 0u) - 1u)) != 0) {
      reduce_partials_kernel<T, Op>
          <<<blocks_for(n), kThreads, 0, s>>>(dst, src, nsrc, f.srcs, f.dst, n, divisor, skip);
      return;
    }
  }
  if (launch_vec<T, Op, 16>(d, src, nsrc, n, divisor, skip, s) ||
      launch_vec<T, Op, 8>(d, src, nsrc, n, divisor, skip, s) ||
      launch_vec<T, Op, 4>(d, src, nsrc, n, divisor, skip, s))
    return;
  // Misaligned against each other by less than 4 bytes: element by element (all of it "head").
  reduce_kernel<T, Op, 16><<<blocks_for(n), kThreads, 0, s>>>(d, src, nsrc, n, 0, n, divisor, skip);
}

template <class T>
void by_op(RedOp op, void* dst, const Srcs& src, int nsrc, size_t n, int divisor, const int* k,
           cudaStream_t s, Forms f) {
  switch (op) {
    case RedOp::sum:
    case RedOp::avg:
      return launch<T, Sum>(dst, src, nsrc, n, divisor, k, s, f);
    case RedOp::prod:
      return launch<T, Prod>(dst, src, nsrc, n, divisor, k, s, f);
    case RedOp::min:
      return launch<T, Min>(dst, src, nsrc, n, divisor, k, s, f);
    case RedOp::max:
      return launch<T, Max>(dst, src, nsrc, n, divisor, k, s, f);
    case RedOp::kCount:
      break;
  }
  throw InvalidArgument("reduce_cuda: bad op code " + std::to_string(int(op)));
}

}  // namespace

void reduce_many_cuda(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
                      size_t count, int avg_divisor, const int* skip, cudaStream_t s,
                      uint32_t partial_srcs, bool partial_dst) {
  if (nsrc < 1 || nsrc > kMaxReduceSrcs)
    throw InvalidArgument(std::string("reduce_cuda: ") + std::to_string(nsrc) + " sources (dtype " +
                          dtype_name(dtype) + ", op " + op_name(op) + ", count " +
                          std::to_string(count) + "); one kernel takes 1 to " +
                          std::to_string(kMaxReduceSrcs));
  if (op == RedOp::avg && !is_float(dtype))
    throw InvalidArgument(std::string("reduce_cuda: avg needs a floating-point dtype, got ") +
                          dtype_name(dtype));
  if (count == 0) return;
  Srcs src{};
  for (int j = 0; j < nsrc; ++j) src.p[j] = srcs[j];
  const int d = op == RedOp::avg && avg_divisor > 0 ? avg_divisor : 0;
  const Forms f{partial_srcs, partial_dst};
  switch (dtype) {
    case DType::f16:
      by_op<__half>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::bf16:
      by_op<__nv_bfloat16>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::f32:
      by_op<float>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::f64:
      by_op<double>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::i8:
      by_op<int8_t>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::u8:
      by_op<uint8_t>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::i32:
      by_op<int32_t>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::i64:
      by_op<int64_t>(op, dst, src, nsrc, count, d, skip, s, f);
      break;
    case DType::boolean:
      if (op == RedOp::sum || op == RedOp::max)
        launch<uint8_t, Or>(dst, src, nsrc, count, 0, skip, s);
      else
        launch<uint8_t, And>(dst, src, nsrc, count, 0, skip, s);
      break;
    case DType::kCount:
      throw InvalidArgument("reduce_cuda: bad dtype code");
  }
  check_launch("reduce", dtype, count);
}

void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 int avg_divisor, const int* skip, cudaStream_t s, uint32_t partial_srcs,
                 bool partial_dst) {
  const void* srcs[2] = {a, b};
  reduce_many_cuda(dtype, op, dst, srcs, 2, count, avg_divisor, skip, s, partial_srcs, partial_dst);
}

void copy_cuda(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
               const int* skip, cudaStream_t s) {
  if (width == 0 || rows == 0) return;
  if (rows == 1) dpitch = spitch = width;
  // The widest word that every address, pitch and the row width are a multiple of.
  const uintptr_t all = uintptr_t(dst) | uintptr_t(src) | dpitch | spitch | width;
  const int B = all % 16 == 0 ? 16 : all % 8 == 0 ? 8 : all % 4 == 0 ? 4 : all % 2 == 0 ? 2 : 1;
  const int64_t per_row = int64_t(width) / B, total = per_row * int64_t(rows);
  char* d = static_cast<char*>(dst);
  const char* x = static_cast<const char*>(src);
  const unsigned g = blocks_for(total);
  switch (B) {
    case 16:
      copy_kernel<16><<<g, kThreads, 0, s>>>(d, dpitch, x, spitch, per_row, total, skip);
      break;
    case 8:
      copy_kernel<8><<<g, kThreads, 0, s>>>(d, dpitch, x, spitch, per_row, total, skip);
      break;
    case 4:
      copy_kernel<4><<<g, kThreads, 0, s>>>(d, dpitch, x, spitch, per_row, total, skip);
      break;
    case 2:
      copy_kernel<2><<<g, kThreads, 0, s>>>(d, dpitch, x, spitch, per_row, total, skip);
      break;
    default:
      copy_kernel<1><<<g, kThreads, 0, s>>>(d, dpitch, x, spitch, per_row, total, skip);
      break;
  }
  check_launch("copy", DType::u8, width * rows);
}

}  // namespace plait
