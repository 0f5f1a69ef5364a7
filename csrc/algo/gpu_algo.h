// What a GPU algorithm works with (CUDA builds only): NCCL point-to-point and collectives on one
// communicator, plait's reduction kernels, a scratch area of two chunks, all on the caller's
// stream. GPU algorithms see this view, never the GPU communicator behind it.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "algo/algo.h"
#include "algo/gpu_plan.h"
#include "cuda/nccl_abi.h"

namespace plait {

class GpuOps {  // implemented by the GPU communicator: every call checks and throws
 public:
  virtual ~GpuOps() = default;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void send(const void* buf, size_t bytes, int peer) = 0;
  virtual void recv(void* buf, size_t bytes, int peer) = 0;
  virtual void all_reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op) = 0;
  virtual void reduce_scatter(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op) = 0;
  virtual void all_gather(const void* in, void* out, size_t bytes) = 0;
};

struct GpuCtx {
  GpuOps& ops;
  const CallArgs& a;  // in/out are device pointers
  cudaStream_t stream;
  size_t esize;
  int rank, size;
  int64_t chunk_elems;  // scratch holds two chunks of this many elements
  char* scratch;

  const char* in_at(int64_t e) const { return static_cast<const char*>(a.in) + e * int64_t(esize); }
  char* out_at(int64_t e) const { return static_cast<char*>(a.out) + e * int64_t(esize); }
  char* scratch_at(int slot) const { return scratch + size_t(slot) * size_t(chunk_elems) * esize; }
  size_t bytes(int64_t elems) const { return size_t(elems) * esize; }
  // dst = x op y over n elements; `final` applies avg's division (the step that finishes a value).
  void reduce(void* dst, const void* x, const void* y, int64_t n, bool final) const;
  void copy(void* dst, const void* src, int64_t n) const;
};

struct GpuAlgorithm {
  Coll coll;
  const char* name;
  void (*run)(GpuCtx&);
};

// allreduce: nccl, ring, tree; reduce_scatter: nccl, ring; allgather: nccl, ring.
const std::vector<GpuAlgorithm>& gpu_algorithm_table();

}  // namespace plait
