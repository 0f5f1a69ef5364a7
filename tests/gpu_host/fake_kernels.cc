// plait's device code as the fake runtime runs it: the reduction kernels (their arithmetic per
// element, reduce/reduce_elem.h, element by element: the code the GPU runs, which test_elem.cc
// compares with the CPU kernels bitwise), the copy kernel and the
// CUDA IPC mapping's post and wait kernels (cuda_ipc.cu's protocol step for step: release stores
// of epochs, acquire loads, the abort word, the deadline, poison and the skip word) over host
// memory that the ranks (threads of one process) share. Each runs on its stream's executor.
#include <time.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "fake_cuda.h"
#include "reduce/reduce.h"
#include "reduce/reduce_cuda.h"
#include "reduce/reduce_elem.h"
#include "transport/cuda_ipc_mapping.h"

namespace fake {
namespace {
std::atomic<int> g_jitter_us{0};
}
void set_jitter_us(int us) { g_jitter_us = us; }
void jitter() {
  const int j = g_jitter_us.load();
  if (j <= 0) return;
  thread_local std::mt19937 rng(std::random_device{}());
  std::this_thread::sleep_for(std::chrono::microseconds(rng() % unsigned(j)));
}
}  // namespace fake

namespace plait {
namespace {

bool skipped(const int* skip) { return skip && __atomic_load_n(skip, __ATOMIC_ACQUIRE) != 0; }

uint64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// reduce_cuda.cu's kernels element by element: reduce_at over the sources, then the store.
template <class T, class Op>
void run_elems(void* dst, const std::vector<const void*>& p, uint32_t partial_srcs,
               bool partial_dst, size_t count, int divisor) {
  for (size_t i = 0; i < count; ++i) {
    const auto acc =
        elem::reduce_at<T, Op>(p.data(), int(p.size()), partial_srcs, int64_t(i), divisor);
    if (partial_dst && sizeof(acc) != sizeof(T))
      static_cast<elem::AccT<T>*>(dst)[i] = acc;
    else
      static_cast<T*>(dst)[i] = elem::narrow<T>(acc);
  }
}

template <class T>
void by_op(RedOp op, void* dst, const std::vector<const void*>& p, uint32_t ps, bool pd, size_t n,
           int d) {
  switch (op) {
    case RedOp::sum:
    case RedOp::avg:
      return run_elems<T, elem::Sum>(dst, p, ps, pd, n, d);
    case RedOp::prod:
      return run_elems<T, elem::Prod>(dst, p, ps, pd, n, d);
    case RedOp::min:
      return run_elems<T, elem::Min>(dst, p, ps, pd, n, d);
    case RedOp::max:
      return run_elems<T, elem::Max>(dst, p, ps, pd, n, d);
    case RedOp::kCount:
      break;
  }
}

void run_reduce(DType t, RedOp op, void* dst, const std::vector<const void*>& p, uint32_t ps,
                bool pd, size_t n, int avg_divisor) {
  const int d = op == RedOp::avg && avg_divisor > 0 ? avg_divisor : 0;
  // For types whose partial is an element the flags change nothing (reduce.h).
  const bool half = t == DType::f16 || t == DType::bf16;
  if (!half) ps = 0, pd = false;
  switch (t) {
    case DType::f16:
      return by_op<__half>(op, dst, p, ps, pd, n, d);
    case DType::bf16:
      return by_op<__nv_bfloat16>(op, dst, p, ps, pd, n, d);
    case DType::f32:
      return by_op<float>(op, dst, p, ps, pd, n, d);
    case DType::f64:
      return by_op<double>(op, dst, p, ps, pd, n, d);
    case DType::i8:
      return by_op<int8_t>(op, dst, p, ps, pd, n, d);
    case DType::u8:
      return by_op<uint8_t>(op, dst, p, ps, pd, n, d);
    case DType::i32:
      return by_op<int32_t>(op, dst, p, ps, pd, n, d);
    case DType::i64:
      return by_op<int64_t>(op, dst, p, ps, pd, n, d);
    case DType::boolean:
      if (op == RedOp::sum || op == RedOp::max)
        return run_elems<uint8_t, elem::Or>(dst, p, 0, false, n, 0);
      return run_elems<uint8_t, elem::And>(dst, p, 0, false, n, 0);
    case DType::kCount:
      return;
  }
}

}  // namespace

void reduce_many_cuda(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
                      size_t count, int avg_divisor, const int* skip, cudaStream_t stream,
                      uint32_t partial_srcs, bool partial_dst) {
  if (nsrc < 1 || nsrc > kMaxReduceSrcs) throw InvalidArgument("reduce_cuda (fake): bad nsrc");
  if (op == RedOp::avg && !is_float(dtype))
    throw InvalidArgument("reduce_cuda (fake): avg needs a floating-point dtype");
  const std::vector<const void*> p(srcs, srcs + nsrc);
  fake::launch(stream, [=] {
    fake::jitter();
    if (!skipped(skip) && count)
      run_reduce(dtype, op, dst, p, partial_srcs, partial_dst, count, avg_divisor);
  });
}

void reduce_cuda(DType dtype, RedOp op, void* dst, const void* a, const void* b, size_t count,
                 int avg_divisor, const int* skip, cudaStream_t stream, uint32_t partial_srcs,
                 bool partial_dst) {
  const void* srcs[2] = {a, b};
  reduce_many_cuda(dtype, op, dst, srcs, 2, count, avg_divisor, skip, stream, partial_srcs,
                   partial_dst);
}

void copy_cuda(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t rows,
               const int* skip, cudaStream_t stream) {
  fake::launch(stream, [=] {
    fake::jitter();
    if (skipped(skip)) return;
    for (size_t r = 0; r < rows; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                   width);
  });
}

// -- the IPC mapping ------------------------------------------------------------------------------

IpcMapping::IpcMapping(int rank, int size, int device, size_t staging_bytes)
    : rank_(rank),
      size_(size),
      device_(device),
      staging_bytes_(staging_bytes / 256 * 256),
      base_(size_t(size), nullptr) {
  void* mine = nullptr;
  if (cudaMalloc(&mine, kFlagBytes + staging_bytes_) != cudaSuccess)
    throw PlaitError("CUDA IPC transport (fake): cudaMalloc failed");
  std::memset(mine, 0, kFlagBytes);
  base_[size_t(rank)] = static_cast<char*>(mine);
  host_words_ = new int[2]{0, 0};
  dev_words_ = const_cast<int*>(host_words_);
  flag_ptrs_ = new uint64_t*[size_t(size)]();
}

IpcMapping::~IpcMapping() {
  cudaFree(base_[size_t(rank_)]);
  delete[] flag_ptrs_;
  delete[] host_words_;
}

std::string IpcMapping::handle() const {
  std::string h(64, '\0');  // a cudaIpcMemHandle_t is 64 bytes; here it carries the address
  const char* p = base_[size_t(rank_)];
  std::memcpy(&h[0], &p, sizeof p);
  return h;
}

void IpcMapping::open(const std::vector<std::string>& handles) {
  if (handles.size() != size_t(size_))
    throw InvalidArgument("CUDA IPC transport: one handle per rank is needed");
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) std::memcpy(&base_[size_t(r)], handles[size_t(r)].data(), sizeof(char*));
    flag_ptrs_[r] = reinterpret_cast<uint64_t*>(base_[size_t(r)]);
  }
}

void IpcMapping::post(int which, uint64_t epoch, cudaStream_t s) {
  uint64_t* flag = reinterpret_cast<uint64_t*>(base_[size_t(rank_)]) + which;
  const int* skip = skip_word();
  fake::launch(s, [=] {
    fake::jitter();
    __atomic_store_n(flag, skipped(skip) ? IpcMapping::kPoison : epoch, __ATOMIC_RELEASE);
  });
}

void IpcMapping::wait(int which, uint64_t epoch, uint64_t timeout_ns, cudaStream_t s, int peer) {
  int* skip = const_cast<int*>(skip_word());
  int* words = dev_words_;
  uint64_t** flags = flag_ptrs_;
  const int self = rank_, n = size_;
  fake::launch(s, [=] {
    fake::jitter();
    if (skipped(skip)) return;
    const uint64_t start = now_ns();
    // The kernel's threads, one per peer, one after another: each returns when its peer's flag
    // reached the epoch, or gives up as the kernel does.
    for (int p = 0; p < n; ++p) {
      if (p == self || (peer >= 0 && p != peer)) continue;
      for (int i = 0;; ++i) {
        const uint64_t v = __atomic_load_n(flags[p] + which, __ATOMIC_ACQUIRE);
        int why = IpcMapping::ok;
        if (v & IpcMapping::kPoison)
          why = IpcMapping::peer_gave_up;
        else if (v >= epoch)
          break;
        else if (__atomic_load_n(&words[0], __ATOMIC_ACQUIRE) != 0)
          why = IpcMapping::aborted;
        else if (now_ns() - start > timeout_ns)
          why = IpcMapping::timed_out;
        if (why != IpcMapping::ok) {
          int none = IpcMapping::ok;
          __atomic_compare_exchange_n(&words[1], &none, why, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE);
          __atomic_store_n(skip, 1, __ATOMIC_RELEASE);
          return;
        }
        if (i > 64) std::this_thread::sleep_for(std::chrono::microseconds(5));
      }
    }
  });
}

void IpcMapping::abort() {
  __atomic_store_n(const_cast<int*>(&host_words_[0]), 1, __ATOMIC_RELEASE);
}

int IpcMapping::error() const {
  return __atomic_load_n(const_cast<int*>(&host_words_[1]), __ATOMIC_ACQUIRE);
}

}  // namespace plait
