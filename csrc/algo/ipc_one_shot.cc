// One-shot collectives over the CUDA IPC transport, per window of the staging size:
// copy this rank's input into its staging, publish (post + wait for every peer: one
// synchronisation), then read every peer's staging straight from its device memory, and say so
// (finish). allreduce: each rank reduces all n stagings in rank order in one kernel (bitwise-equal
// results, and equal to the CPU kernels': halves accumulate in float32; avg divides the sum),
// reading (n - 1) copies of the vector from peers. reduce_scatter: each rank reduces block r of
// every staging. allgather: each rank copies every staging into its block of the output.
// Small and latency-bound by design: one exchange per window, no pipelining.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
#include "reduce/reduce_cuda.h"

namespace plait {

void ipc_allreduce_one_shot(IpcCtx& c) {
  for (const Span& w :
       chunk_plan(c.a.count, std::max<int64_t>(1, int64_t(c.tp.staging_bytes() / c.esize)))) {
    const uint64_t e = c.begin();
    c.copy(c.tp.staging(c.rank), c.in_at(w.offset), w.count);
    c.publish(e);
    std::vector<const char*> srcs;
    for (int p = 0; p < c.size; ++p) srcs.push_back(c.tp.staging(p));
    c.reduce_all(c.out_at(w.offset), srcs, w.count);
    c.finish(e);
  }
}

void ipc_reduce_scatter_one_shot(IpcCtx& c) {
  const int64_t m = c.a.count,
                per_block = std::max<int64_t>(1, int64_t(c.tp.staging_bytes() / c.esize) / c.size);
  for (const Span& w : chunk_plan(m, per_block)) {
    const uint64_t e = c.begin();
    // Window w of every block of the input, side by side in the staging (a kernel: blocks of
    // 2 GiB and more are beyond cudaMemcpy2DAsync's pitch limit).
    c.copy_rows(c.tp.staging(c.rank), per_block, c.in_at(w.offset), m, w.count, c.size);
    c.publish(e);
    std::vector<const char*> srcs;
    for (int p = 0; p < c.size; ++p)
      srcs.push_back(c.tp.staging(p) + c.bytes(per_block) * size_t(c.rank));
    c.reduce_all(c.out_at(w.offset), srcs, w.count);
    c.finish(e);
  }
}

void ipc_allgather_one_shot(IpcCtx& c) {
  const int64_t m = c.a.count;
  for (const Span& w :
       chunk_plan(m, std::max<int64_t>(1, int64_t(c.tp.staging_bytes() / c.esize)))) {
    const uint64_t e = c.begin();
    c.copy(c.tp.staging(c.rank), c.in_at(w.offset), w.count);
    c.publish(e);
    for (int p = 0; p < c.size; ++p)
      c.copy(c.out_at(int64_t(p) * m + w.offset), c.tp.staging(p), w.count);
    c.finish(e);
  }
}

}  // namespace plait
