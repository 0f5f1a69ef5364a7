// Rings over the CUDA IPC transport, around r -> r + 1 (ipc_ring_plan). Passing a block right is
// posting it in this rank's staging (two slots, so a rank fills one while its right neighbour
// still reads the other); the right neighbour reduces it with its own input block straight into
// its staging, so a partial crosses each hop once and is never copied on the way. The owner of a
// block finishes it once and the allgather forwards those bytes unchanged, so
// every rank ends with identical bytes. Waits are per neighbour: a step waits for the left's post
// of the epoch it reads and, before overwriting a slot, for the right's "done" with it.
// allreduce: rounds of n blocks of at most half the staging, 2 (n - 1) steps each; each rank
// reads 2 (n - 1) / n of the vector from its left neighbour (one_shot reads n - 1 vectors from
// all peers). reduce_scatter and allgather: per window of half the staging, n - 1 steps; each
// rank reads (n - 1) blocks. Steps are ordered on one stream: no overlap of transfer and
// arithmetic yet.
#include <algorithm>

#include "algo/gpu_algo.h"

namespace plait {
namespace {

void run_ring(IpcCtx& c) {
  const int n = c.size;
  // While a block is being reduced its slot holds partials (float32 for f16/bf16: a sum crossing
  // n - 1 hops rounds once, at the finish, as on the CPU); gathered blocks are elements.
  const size_t unit = c.a.coll == Coll::allgather ? c.esize : c.psize();
  const int64_t slot_elems = std::max<int64_t>(1, int64_t(c.tp.staging_bytes() / unit / 2));
  const std::vector<IpcRingStep> plan = ipc_ring_plan(c.a.coll, c.rank, n, c.a.count, slot_elems);
  if (plan.empty())
    return c.copy(c.a.out, c.a.in, c.a.count);  // one rank (avg divides by 1), or nothing
  if (c.a.coll == Coll::allgather) c.copy(c.out_at(c.rank * c.a.count), c.a.in, c.a.count);
  const int left = (c.rank + n - 1) % n, right = (c.rank + 1) % n;
  // begin(): every peer is done with this rank's staging of earlier calls, whatever they read.
  const uint64_t base = c.begin() - 1;
  const auto slot = [&](int p, uint64_t e) {
    return c.tp.staging(p) + size_t(e % 2) * size_t(slot_elems) * unit;
  };
  for (const IpcRingStep& s : plan) {
    const uint64_t read = base + uint64_t(s.read), post = base + uint64_t(s.post);
    const char* from = s.read ? slot(left, read) : nullptr;
    char* to = s.post ? slot(c.rank, post) : nullptr;
    if (s.read) c.tp.wait(IpcMapping::kPost, read, c.timeout_ns, c.stream, left);
    // The slot last held epoch post - 2; those of earlier calls are covered by begin().
    if (s.post > 2) c.tp.wait(IpcMapping::kDone, post - 2, c.timeout_ns, c.stream, right);
    switch (s.kind) {
      case IpcRingStep::load:
        c.to_partials(to, c.in_at(s.in_offset), s.count);
        break;
      case IpcRingStep::reduce:
        c.reduce(to, from, c.in_at(s.in_offset), s.count, false, true, true);
        break;
      case IpcRingStep::finish:  // avg: the sum is divided by n here, once; rounded once
        c.reduce(to ? to : c.out_at(s.out_offset), from, c.in_at(s.in_offset), s.count, true, true);
        if (to) c.copy(c.out_at(s.out_offset), to, s.count);
        break;
      case IpcRingStep::gather:
        c.copy(c.out_at(s.out_offset), from, s.count);
        if (to) c.copy(to, c.out_at(s.out_offset), s.count);
        break;
    }
    if (s.read) c.tp.post(IpcMapping::kDone, read, c.stream);
    if (s.post) c.tp.post(IpcMapping::kPost, post, c.stream);
  }
  c.epoch = base + uint64_t(plan.back().read);  // the last step reads the last epoch anyone posted
}

}  // namespace

void ipc_allreduce_ring(IpcCtx& c) { run_ring(c); }
void ipc_reduce_scatter_ring(IpcCtx& c) { run_ring(c); }
void ipc_allgather_ring(IpcCtx& c) { run_ring(c); }

}  // namespace plait
