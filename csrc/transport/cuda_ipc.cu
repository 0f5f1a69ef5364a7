#include "transport/cuda_ipc_mapping.h"

#include <cstring>

#include "core/errors.h"

namespace plait {
namespace {

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void post_kernel(uint64_t* flag, uint64_t epoch, const volatile int* skip) {
  __threadfence_system();  // everything this stream wrote before is visible before the flag
  // After a wait of this rank gave up, what this stream wrote is not what the epoch promises.
  store_release(flag, *skip != 0 ? IpcMapping::kPoison : epoch);
}

// Ranks sharing one GPU without MPS are time-sliced, and a spinning wait keeps its context on the
// GPU (__nanosleep does not yield it): a cross-rank hand-off then costs about one time slice
// (review 2, finding 11). Run such jobs under MPS (nvidia-cuda-mps-control -d); tests/gpu/run.sh
// measures the hand-off with and without it. cuStreamWaitValue64 would hold no SM but loses the
// poison and deadline logic below, which would move to host-side abort writes; not done.
// One thread per peer (or only `only`'s when >= 0). Gives up on the host's abort, the deadline,
// a peer's poison or an earlier give-up of this rank (skip), and then says why in words[1] and
// sets skip. Plain stores, not atomics: atomics on mapped host memory are not atomic over PCIe,
// and any of the reasons is a true one.
__global__ void wait_kernel(uint64_t** flags, int which, int self, int only, int n, uint64_t epoch,
                            uint64_t timeout_ns, volatile int* words, volatile int* skip) {
  const int p = int(threadIdx.x);
  if (p >= n || p == self || (only >= 0 && p != only) || *skip != 0) return;
  const uint64_t* f = flags[p] + which;
  const uint64_t start = global_ns();
  // The abort word lives in mapped host memory: each read is a PCIe round trip (~1 us), so it is
  // read every 16th poll (a few us of delay on an abort), not on every one (review 2, finding 10).
  unsigned polls = 0;
  for (;;) {
    const uint64_t v = load_acquire(f);
    int why = IpcMapping::ok;
    if (v & IpcMapping::kPoison)
      why = IpcMapping::peer_gave_up;
    else if (v >= epoch)
      return;
    else if ((++polls & 15u) == 0 && words[0] != 0)
      why = IpcMapping::aborted;
    else if (global_ns() - start > timeout_ns)
      why = IpcMapping::timed_out;
    else if (*skip != 0)
      return;  // another thread of this kernel gave up and said why
    if (why != IpcMapping::ok) {
      if (words[1] == IpcMapping::ok) words[1] = why;
      *skip = 1;
      __threadfence_system();
      return;
    }
    __nanosleep(200);
  }
}

void cuda_check(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw PlaitError("CUDA IPC transport: " + what + ": " + cudaGetErrorString(e));
}

}  // namespace

IpcMapping::IpcMapping(int rank, int size, int device, size_t staging_bytes)
    : rank_(rank),
      size_(size),
      device_(device),
      staging_bytes_(staging_bytes / 256 * 256),
      base_(size_t(size), nullptr) {
  char* mine = nullptr;
  cuda_check(cudaMalloc(reinterpret_cast<void**>(&mine), kFlagBytes + staging_bytes_),
             "cudaMalloc of " + std::to_string(kFlagBytes + staging_bytes_) + " bytes");
  base_[size_t(rank)] = mine;
  cuda_check(cudaMemset(mine, 0, kFlagBytes), "cudaMemset");
  cuda_check(cudaHostAlloc(const_cast<int**>(&host_words_), 2 * sizeof(int), cudaHostAllocMapped),
             "cudaHostAlloc");
  host_words_[0] = host_words_[1] = 0;
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev_words_),
                                      const_cast<int*>(host_words_), 0),
             "cudaHostGetDevicePointer");
  cuda_check(cudaMalloc(reinterpret_cast<void**>(&flag_ptrs_), sizeof(uint64_t*) * size_t(size)),
             "cudaMalloc");
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

IpcMapping::~IpcMapping() {
  for (int r = 0; r < size_; ++r) {
    if (!base_[size_t(r)]) continue;
    if (r == rank_)
      cudaFree(base_[size_t(r)]);
    else
      cudaIpcCloseMemHandle(base_[size_t(r)]);
  }
  if (flag_ptrs_) cudaFree(flag_ptrs_);
  if (host_words_) cudaFreeHost(const_cast<int*>(host_words_));
}

std::string IpcMapping::handle() const {
  cudaIpcMemHandle_t h;
  cuda_check(cudaIpcGetMemHandle(&h, base_[size_t(rank_)]), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

void IpcMapping::open(const std::vector<std::string>& handles) {
  if (handles.size() != size_t(size_))
    throw InvalidArgument("CUDA IPC transport: one handle per rank is needed");
  std::vector<uint64_t*> flags(static_cast<size_t>(size_));
  for (int r = 0; r < size_; ++r) {
    if (r != rank_) {
      cudaIpcMemHandle_t h;
      if (handles[size_t(r)].size() != sizeof h)
        throw InvalidArgument("CUDA IPC transport: bad handle from rank " + std::to_string(r));
      std::memcpy(&h, handles[size_t(r)].data(), sizeof h);
      void* p = nullptr;
      cuda_check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                 "rank " + std::to_string(rank_) + " mapping rank " + std::to_string(r) +
                     "'s memory (cudaIpcOpenMemHandle)");
      base_[size_t(r)] = static_cast<char*>(p);
    }
    flags[size_t(r)] = reinterpret_cast<uint64_t*>(base_[size_t(r)]);
  }
  cuda_check(cudaMemcpy(flag_ptrs_, flags.data(), sizeof(uint64_t*) * flags.size(),
                        cudaMemcpyHostToDevice),
             "cudaMemcpy");
}

void IpcMapping::post(int which, uint64_t epoch, cudaStream_t s) {
  post_kernel<<<1, 1, 0, s>>>(reinterpret_cast<uint64_t*>(base_[size_t(rank_)]) + which, epoch,
                              reinterpret_cast<const volatile int*>(skip_word()));
  cuda_check(cudaGetLastError(), "post kernel launch");
}

void IpcMapping::wait(int which, uint64_t epoch, uint64_t timeout_ns, cudaStream_t s, int peer) {
  const int threads = (size_ + 31) / 32 * 32;
  wait_kernel<<<1, threads, 0, s>>>(
      flag_ptrs_, which, rank_, peer, size_, epoch, timeout_ns, dev_words_,
      const_cast<volatile int*>(reinterpret_cast<const volatile int*>(skip_word())));
  cuda_check(cudaGetLastError(), "wait kernel launch");
}

void IpcMapping::abort() { host_words_[0] = 1; }

int IpcMapping::error() const { return host_words_[1]; }

}  // namespace plait
