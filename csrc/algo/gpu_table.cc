// The ordered table of GPU algorithms. "auto" picks the first of a collective (nccl): no GPU
// measurement has been made yet to place a threshold between NCCL and plait's own algorithms.
#include <cuda_runtime_api.h>

#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
#include "reduce/reduce_cuda.h"

namespace plait {

void gpu_allreduce_nccl(GpuCtx&);
void gpu_reduce_scatter_nccl(GpuCtx&);
void gpu_allgather_nccl(GpuCtx&);
void gpu_allreduce_ring(GpuCtx&);
void gpu_reduce_scatter_ring(GpuCtx&);
void gpu_allgather_ring(GpuCtx&);
void gpu_allreduce_tree(GpuCtx&);

const std::vector<GpuAlgorithm>& gpu_algorithm_table() {
  static const std::vector<GpuAlgorithm> table = {
      {Coll::allreduce, "nccl", gpu_allreduce_nccl},
      {Coll::allreduce, "ring", gpu_allreduce_ring},
      {Coll::allreduce, "tree", gpu_allreduce_tree},
      {Coll::reduce_scatter, "nccl", gpu_reduce_scatter_nccl},
      {Coll::reduce_scatter, "ring", gpu_reduce_scatter_ring},
      {Coll::allgather, "nccl", gpu_allgather_nccl},
      {Coll::allgather, "ring", gpu_allgather_ring},
  };
  return table;
}

void GpuCtx::reduce(void* dst, const void* x, const void* y, int64_t n, bool final) const {
  reduce_cuda(a.dtype, a.op, dst, x, y, size_t(n), final ? size : 0, stream);
}

void GpuCtx::copy(void* dst, const void* src, int64_t n) const {
  if (dst == src || n == 0) return;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes(n), cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess)
    throw PlaitError(std::string("rank ") + std::to_string(rank) + ": " + coll_name(a.coll) +
                     ": cudaMemcpyAsync of " + std::to_string(bytes(n)) + " bytes failed: " + cudaGetErrorString(e));
}

}  // namespace plait
