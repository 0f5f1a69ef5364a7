// What a GPU algorithm works with (CUDA builds only): NCCL point-to-point and collectives on one
// communicator, plait's reduction kernels, a scratch area of two chunks, all on the caller's
// stream. GPU algorithms see this view, never the GPU communicator behind it.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "algo/algo.h"
#include "algo/plan.h"
#include "cuda/nccl_abi.h"
#include "transport/cuda_ipc_mapping.h"
#include "transport/nccl.h"  // GpuOps

namespace plait {

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
  size_t psize() const { return partial_size(a.dtype); }  // bytes of a partial (reduce.h)
  // Elements a scratch slot holds as partials (fewer than chunk_elems for f16/bf16).
  int64_t chunk_partials() const {
    return std::max<int64_t>(1, chunk_elems * int64_t(esize) / int64_t(psize()));
  }
  // dst = x op y over n elements; `finish`: this step completes the reduction, so for avg the
  // sum is divided by the rank count here (sum, then divide, as the CPU path; reduce.h).
  // x_partial: x holds float32 partials (f16/bf16); partial_dst: dst gets them.
  void reduce(void* dst, const void* x, const void* y, int64_t n, bool finish,
              bool x_partial = false, bool partial_dst = false) const;
  // dst = srcs[0] op srcs[1] op ... in one kernel, partials marked as in reduce.h.
  void reduce_n(void* dst, const std::vector<const void*>& srcs, int64_t n, bool finish,
                uint32_t partial_srcs, bool partial_dst) const;
  void copy(void* dst, const void* src, int64_t n) const;
  // n elements of src into dst as partials (widened for f16/bf16, a copy otherwise).
  void to_partials(void* dst, const void* src, int64_t n) const;
};

// The view an algorithm over the CUDA IPC transport works in. Epochs count exchanges over the
// communicator's life: begin() waits until every peer has finished reading this rank's staging
// of the previous epoch, publish() posts this rank's staging and waits for every peer's,
// finish() says this rank is done reading the others'.
struct IpcCtx {
  IpcMapping& tp;
  const CallArgs& a;
  cudaStream_t stream;
  size_t esize;
  int rank, size;
  uint64_t& epoch;
  uint64_t timeout_ns;

  uint64_t begin() {
    const uint64_t e = ++epoch;
    if (e > 1) tp.wait(IpcMapping::kDone, e - 1, timeout_ns, stream);
    return e;
  }
  void publish(uint64_t e) {
    tp.post(IpcMapping::kPost, e, stream);
    tp.wait(IpcMapping::kPost, e, timeout_ns, stream);
  }
  void finish(uint64_t e) { tp.post(IpcMapping::kDone, e, stream); }
  const char* in_at(int64_t e) const { return static_cast<const char*>(a.in) + e * int64_t(esize); }
  char* out_at(int64_t e) const { return static_cast<char*>(a.out) + e * int64_t(esize); }
  size_t bytes(int64_t elems) const { return size_t(elems) * esize; }
  size_t psize() const { return partial_size(a.dtype); }  // bytes of a partial (reduce.h)
  // As GpuCtx's; every kernel is guarded by the transport's skip word, so once a wait of this
  // call gave up, the rest of it moves nothing. x_partial: x holds float32 partials (f16/bf16),
  // partial_dst: dst gets them (reduce.h), so sums that travel between ranks round only once.
  void reduce(void* dst, const void* x, const void* y, int64_t n, bool finish,
              bool x_partial = false, bool partial_dst = false) const;
  void copy(void* dst, const void* src, int64_t n) const;
  // n elements of src into dst as partials (widened for f16/bf16, a copy otherwise).
  void to_partials(void* dst, const void* src, int64_t n) const;
  // `rows` rows of n elements, rows spitch/dpitch elements apart.
  void copy_rows(void* dst, int64_t dpitch, const void* src, int64_t spitch, int64_t n,
                 int64_t rows) const;
  // dst = srcs[0] op srcs[1] op ... in rank order, one kernel (the halves accumulate in float32
  // and round once; avg divides the finished sum): bitwise the same on every rank and as the CPU
  // kernels' n-source reduce().
  void reduce_all(void* dst, const std::vector<const char*>& srcs, int64_t n) const;
};

}  // namespace plait
