// The GPU algorithms' views: the reductions and copies GpuCtx and IpcCtx enqueue on the call's
// stream. The algorithms themselves are rows of the one table (algo/table.cc).
#include <cuda_runtime_api.h>

#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
#include "reduce/reduce_cuda.h"

namespace plait {

void IpcCtx::reduce(void* dst, const void* x, const void* y, int64_t n, bool finish, bool x_partial,
                    bool partial_dst) const {
  reduce_cuda(a.dtype, a.op, dst, x, y, size_t(n), finish ? size : 0, tp.skip_word(), stream,
              x_partial ? 1u : 0u, partial_dst);
}

void IpcCtx::to_partials(void* dst, const void* src, int64_t n) const {
  if (psize() == esize) return copy(dst, src, n);
  if (n == 0) return;
  reduce_many_cuda(a.dtype, a.op, dst, &src, 1, size_t(n), 0, tp.skip_word(), stream, 0, true);
}

void IpcCtx::copy(void* dst, const void* src, int64_t n) const {
  if (dst == src || n == 0) return;
  copy_cuda(dst, bytes(n), src, bytes(n), bytes(n), 1, tp.skip_word(), stream);
}

void IpcCtx::copy_rows(void* dst, int64_t dpitch, const void* src, int64_t spitch, int64_t n,
                       int64_t rows) const {
  copy_cuda(dst, bytes(dpitch), src, bytes(spitch), bytes(n), size_t(rows), tp.skip_word(), stream);
}

void IpcCtx::reduce_all(void* dst, const std::vector<const char*>& srcs, int64_t n) const {
  if (srcs.size() == 1) return copy(dst, srcs[0], n);  // avg over one rank divides by 1
  const std::vector<const void*> p(srcs.begin(), srcs.end());
  reduce_many_cuda(a.dtype, a.op, dst, p.data(), int(p.size()), size_t(n), size, tp.skip_word(),
                   stream);
}

void GpuCtx::reduce(void* dst, const void* x, const void* y, int64_t n, bool finish, bool x_partial,
                    bool partial_dst) const {
  reduce_cuda(a.dtype, a.op, dst, x, y, size_t(n), finish ? size : 0, nullptr, stream,
              x_partial ? 1u : 0u, partial_dst);
}

void GpuCtx::reduce_n(void* dst, const std::vector<const void*>& srcs, int64_t n, bool finish,
                      uint32_t partial_srcs, bool partial_dst) const {
  reduce_many_cuda(a.dtype, a.op, dst, srcs.data(), int(srcs.size()), size_t(n), finish ? size : 0,
                   nullptr, stream, partial_srcs, partial_dst);
}

void GpuCtx::to_partials(void* dst, const void* src, int64_t n) const {
  if (psize() == esize) return copy(dst, src, n);
  if (n == 0) return;
  reduce_many_cuda(a.dtype, a.op, dst, &src, 1, size_t(n), 0, nullptr, stream, 0, true);
}

void GpuCtx::copy(void* dst, const void* src, int64_t n) const {
  if (dst == src || n == 0) return;
  const cudaError_t e = cudaMemcpyAsync(dst, src, bytes(n), cudaMemcpyDeviceToDevice, stream);
  if (e != cudaSuccess)
    throw PlaitError(std::string("rank ") + std::to_string(rank) + ": " + coll_name(a.coll) +
                     ": cudaMemcpyAsync of " + std::to_string(bytes(n)) +
                     " bytes failed: " + cudaGetErrorString(e));
}

}  // namespace plait
