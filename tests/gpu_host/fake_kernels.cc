// plait's device code as the fake runtime runs it: the reduction and copy kernels (arithmetic by
// the CPU kernels, reduce/reduce.h, so results compare with the host path's closed forms) and the
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

}  // namespace

void reduce_many_cuda(DType dtype, RedOp op, void* dst, const void* const* srcs, int nsrc,
                      size_t count, int avg_divisor, const int* skip, cudaStream_t stream,
                      uint32_t partial_srcs, bool partial_dst) {
  if (nsrc < 1 || nsrc > kMaxReduceSrcs) throw InvalidArgument("reduce_cuda (fake): bad nsrc");
  const std::vector<const void*> p(srcs, srcs + nsrc);
  fake::launch(stream, [=] {
    fake::jitter();
    if (!skipped(skip) && count)
      reduce(dtype, op, dst, p.data(), int(p.size()), count, avg_divisor, partial_srcs,
             partial_dst);
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
