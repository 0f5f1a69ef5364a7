// The ordered tables of GPU algorithms (over NCCL; over CUDA IPC). "auto" picks the first of a
// collective (nccl; one_shot): no GPU measurement has been made yet to place thresholds.
// Broadcast, reduce, alltoall and send/recv have only nccl: over CUDA IPC they are refused.
#include <cuda_runtime_api.h>

#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
#include "reduce/reduce_cuda.h"

namespace plait {

void gpu_allreduce_nccl(GpuCtx&);
void gpu_reduce_scatter_nccl(GpuCtx&);
void gpu_allgather_nccl(GpuCtx&);
void gpu_broadcast_nccl(GpuCtx&);
void gpu_reduce_nccl(GpuCtx&);
void gpu_alltoall_nccl(GpuCtx&);
void gpu_send_nccl(GpuCtx&);
void gpu_recv_nccl(GpuCtx&);
void gpu_allreduce_ring(GpuCtx&);
void gpu_reduce_scatter_ring(GpuCtx&);
void gpu_allgather_ring(GpuCtx&);
void gpu_allreduce_tree(GpuCtx&);
void ipc_allreduce_one_shot(IpcCtx&);
void ipc_allreduce_two_shot(IpcCtx&);
void ipc_allreduce_ring(IpcCtx&);
void ipc_reduce_scatter_one_shot(IpcCtx&);
void ipc_allgather_one_shot(IpcCtx&);
void ipc_reduce_scatter_ring(IpcCtx&);
void ipc_allgather_ring(IpcCtx&);

const std::vector<GpuAlgorithm>& gpu_algorithm_table() {
  static const std::vector<GpuAlgorithm> table = {
      {Coll::allreduce, "nccl", gpu_allreduce_nccl},
      {Coll::allreduce, "ring", gpu_allreduce_ring},
      {Coll::allreduce, "tree", gpu_allreduce_tree},
      {Coll::reduce_scatter, "nccl", gpu_reduce_scatter_nccl},
      {Coll::reduce_scatter, "ring", gpu_reduce_scatter_ring},
      {Coll::allgather, "nccl", gpu_allgather_nccl},
      {Coll::allgather, "ring", gpu_allgather_ring},
      {Coll::broadcast, "nccl", gpu_broadcast_nccl},
      {Coll::reduce, "nccl", gpu_reduce_nccl},
      {Coll::alltoall, "nccl", gpu_alltoall_nccl},
      {Coll::send, "nccl", gpu_send_nccl},
      {Coll::recv, "nccl", gpu_recv_nccl},
  };
  return table;
}

const std::vector<IpcAlgorithm>& ipc_algorithm_table() {
  static const std::vector<IpcAlgorithm> table = {
      {Coll::allreduce, "one_shot", ipc_allreduce_one_shot},
      {Coll::allreduce, "two_shot", ipc_allreduce_two_shot},
      {Coll::allreduce, "ring", ipc_allreduce_ring},
      {Coll::reduce_scatter, "one_shot", ipc_reduce_scatter_one_shot},
      {Coll::reduce_scatter, "ring", ipc_reduce_scatter_ring},
      {Coll::allgather, "one_shot", ipc_allgather_one_shot},
      {Coll::allgather, "ring", ipc_allgather_ring},
  };
  return table;
}

void IpcCtx::reduce(void* dst, const void* x, const void* y, int64_t n, bool raw_x,
                    bool raw_y) const {
  reduce_cuda(a.dtype, a.op, dst, x, y, size_t(n), AvgScale{size, raw_x, raw_y}, tp.skip_word(),
              stream);
}

void IpcCtx::copy(void* dst, const void* src, int64_t n) const {
  if (dst == src || n == 0) return;
  copy_cuda(dst, bytes(n), src, bytes(n), bytes(n), 1, tp.skip_word(), stream);
}

void IpcCtx::copy_rows(void* dst, int64_t dpitch, const void* src, int64_t spitch, int64_t n,
                       int64_t rows) const {
  copy_cuda(dst, bytes(dpitch), src, bytes(spitch), bytes(n), size_t(rows), tp.skip_word(), stream);
}

void IpcCtx::load(void* dst, const void* src, int64_t n) const {
  if (a.op != RedOp::avg || size == 1) return copy(dst, src, n);
  divide_cuda(a.dtype, dst, src, size_t(n), size, tp.skip_word(), stream);
}

void IpcCtx::reduce_all(void* dst, const std::vector<const char*>& srcs, int64_t n) const {
  if (srcs.size() == 1) return copy(dst, srcs[0], n);  // avg over one rank divides by 1
  for (size_t k = 1; k < srcs.size(); ++k)
    reduce(dst, k == 1 ? srcs[0] : dst, srcs[k], n, k == 1, true);
}

void GpuCtx::reduce(void* dst, const void* x, const void* y, int64_t n, bool raw_x,
                    bool raw_y) const {
  reduce_cuda(a.dtype, a.op, dst, x, y, size_t(n), AvgScale{size, raw_x, raw_y}, nullptr, stream);
}

void GpuCtx::copy(void* dst, const void* src, int64_t n) const {
  if (dst == src || n == 0) return;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes(n), cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess)
    throw PlaitError(std::string("rank ") + std::to_string(rank) + ": " + coll_name(a.coll) +
                     ": cudaMemcpyAsync of " + std::to_string(bytes(n)) +
                     " bytes failed: " + cudaGetErrorString(e));
}

void GpuCtx::load(void* dst, const void* src, int64_t n) const {
  if (a.op != RedOp::avg || size == 1) return copy(dst, src, n);
  divide_cuda(a.dtype, dst, src, size_t(n), size, nullptr, stream);
}

}  // namespace plait
