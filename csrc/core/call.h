// One call's arguments, as the communicator checks them and an algorithm runs them.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/types.h"

namespace plait {

// One call as every rank must agree on it. count is in elements: the whole vector for allreduce
// and broadcast/reduce, one rank's block for reduce_scatter (output), allgather (input) and
// alltoall (per peer).
struct CallArgs {
  Coll coll = Coll::barrier;
  DType dtype = DType::f32;
  RedOp op = RedOp::sum;
  int root = 0;
  int peer = -1;
  int64_t tag = 0;
  int64_t count = 0;
  const void* in = nullptr;
  void* out = nullptr;
  int algo = -1;  // index among the collective's rows its transport offers (algo/algo.h); -1 = auto
  double timeout_s = 0;  // >= 0 (0: a wait fails unless its peer is there; inf: no deadline)
};

// A contiguous array as it crosses into plait: host memory, or CUDA device memory on GPU
// `device_index`, used on CUDA stream `stream` (0: the legacy default stream).
struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int device_index = -1;  // the CUDA device (Device::cuda only)
  uintptr_t stream = 0;   // a cudaStream_t (Device::cuda only)
  bool writable = true;
  bool contiguous = true;
  bool present = false;
};

// recv's peer for "from any rank": the first message of its tag from whichever sender.
constexpr int kAnySource = -1;

// The checks every call makes, host or GPU: buffers present, of one dtype and one device, sizes
// that fit a world of `size`, no overlap but in place, root and peer in range, an op the dtype
// takes, a deadline >= 0. Fills `a` (count as CallArgs counts it; algo is left -1) and returns
// "" when the call is sound, else what is wrong, starting "rank R: collective: ".
// any_source: whether recv may take kAnySource (host only: NCCL has no any-source receive).
std::string validate_call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
                          int64_t tag, double timeout_s, int rank, int size, bool any_source,
                          CallArgs* a);

}  // namespace plait
