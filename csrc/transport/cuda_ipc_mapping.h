// The CUDA IPC transport's mapping (transport/cuda_ipc.h drives it): each rank owns one device
// region (flags + staging) that the other ranks of the host map through cudaIpc handles, so ranks
// on one GPU (which NCCL refuses) or on GPUs of one host exchange data through device memory.
// Synchronisation is by monotonic epochs in device memory, published with system-scope release
// stores and read with acquire loads by small kernels on the caller's stream. A waiting kernel
// gives up on a %globaltimer deadline, when the host raises its abort word (mapped host memory) or
// when a peer's flag carries the poison bit; it then reports why in an error word the host reads
// (IpcMapping::error()) and sets this rank's skip word (device memory): every later kernel of the
// rank does nothing (reductions and copies skip, waits return at once) and its posts publish the
// poison instead of an epoch, so no peer takes unready data for ready, and every peer's waits give
// up too.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/types.h"  // gpu_timeout_ns

namespace plait {

class IpcMapping {
 public:
  static constexpr int kPost = 0;  // flag: my staging holds epoch e's data
  static constexpr int kDone = 1;  // flag: I finished reading everyone's staging of epoch e
  enum Error : int { ok = 0, aborted = 1, timed_out = 2, peer_gave_up = 3 };
  static constexpr uint64_t kPoison = uint64_t(1) << 63;  // a flag value: "I gave up"
  static uint64_t clamp_timeout_ns(double seconds) { return gpu_timeout_ns(seconds); }

  IpcMapping(int rank, int size, int device, size_t staging_bytes);
  ~IpcMapping();
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;

  // This rank's cudaIpcMemHandle (64 bytes), to be given to every peer.
  std::string handle() const;
  // Maps every peer's region (handles[rank] is ignored).
  void open(const std::vector<std::string>& handles);

  int rank() const { return rank_; }
  int size() const { return size_; }
  size_t staging_bytes() const { return staging_bytes_; }
  char* staging(int r) const { return base_[size_t(r)] + kFlagBytes; }

  // Enqueued on `s`: publish flag `which` = epoch; wait until every peer's flag `which` >= epoch,
  // or only `peer`'s when peer >= 0 (or give up after timeout_ns, or on the host's abort).
  void post(int which, uint64_t epoch, cudaStream_t s);
  void wait(int which, uint64_t epoch, uint64_t timeout_ns, cudaStream_t s, int peer = -1);

  void abort();       // makes every waiting kernel of this rank give up
  int error() const;  // what a kernel reported (Error), valid once the stream has run
  // Device word: non-zero once a wait of this rank gave up; guards this rank's later kernels.
  const int* skip_word() const {
    return reinterpret_cast<const int*>(base_[size_t(rank_)] + kSkipOffset);
  }

 private:
  static constexpr size_t kFlagBytes = 256;
  static constexpr size_t kSkipOffset = 64;  // in this rank's flag area; peers never read it
  int rank_, size_, device_;
  size_t staging_bytes_;
  std::vector<char*> base_;             // every rank's region as mapped here
  uint64_t** flag_ptrs_ = nullptr;      // device array: each rank's flag words
  volatile int* host_words_ = nullptr;  // [0] abort, [1] error (mapped host memory)
  int* dev_words_ = nullptr;            // the same words as the device sees them
};

}  // namespace plait
