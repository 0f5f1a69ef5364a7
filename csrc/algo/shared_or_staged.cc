// allreduce and allgather "shared_or_staged": single copy when every rank's buffers are plait
// shared buffers that every peer maps, else the staged algorithm that won in the middle sizes
// (allreduce "ring", from kStagedPartsMin "staged_parts"; allgather "direct"). What "auto" runs
// where a kernel copy of private pages is slower than copies through the cache-resident staging,
// but plain loads and stores of a mapped peer buffer are faster than both (table.cc,
// bench/RESULTS.md 2026-12-04 and 2026-12-05).
// Steps: every rank exposes its buffers (channel-0 step 1), says on its post line whether it
// maps every peer's buffers (step 2), and all ranks take the same branch from the AND of those
// answers; 2 synchronisations more than single copy, which costs ~0.2 us against calls of tens
// of microseconds and more. A rank that maps a region but later fails to read through the mapping
// falls back to the kernel copy inside single copy, so the branch never depends on local luck.
#include "algo/algo.h"

namespace plait {
namespace {

// True on every rank, or on none: whether every rank could map every peer's input and output.
bool all_buffers_mapped(Ctx& c, size_t in_bytes, size_t out_bytes) {
  Transport& tp = c.tp;
  tp.expose(c.a.in, c.a.out);
  tp.post(0, 1);
  bool mine = tp.inline_bytes() > 0;
  for (int p = 0; p < c.size && mine; ++p) {
    if (p == c.rank) continue;
    tp.wait_post(p, 0, 1);
    mine = tp.peer_maps(p, tp.peer_in(p), in_bytes) && tp.peer_maps(p, tp.peer_out(p), out_bytes);
  }
  if (tp.inline_bytes() == 0) return false;  // the same on every rank: one transport
  tp.inline_slot(c.rank)[0] = mine ? 1 : 0;
  tp.post(0, 2);
  bool all = mine;
  for (int p = 0; p < c.size; ++p) {
    if (p == c.rank) continue;
    tp.wait_post(p, 0, 2);
    all = all && tp.inline_slot(p)[0] == 1;
  }
  return all;
}

}  // namespace

void allreduce_shared_or_staged(Ctx& c) {
  const size_t bytes = size_t(c.a.count) * c.esize;
  if (all_buffers_mapped(c, bytes, bytes)) return allreduce_single_copy_exposed(c);
  c.tp.ack(0, 2);  // steps 1 and 2 used no staging
  if (bytes >= kStagedPartsMin) return allreduce_staged_parts_rounds(c, 2);
  allreduce_ring_steps(c, 2);
}

void allgather_shared_or_staged(Ctx& c) {
  const size_t bytes = size_t(c.a.count) * c.esize;
  if (all_buffers_mapped(c, bytes, bytes * size_t(c.size))) return allgather_single_copy_exposed(c);
  c.tp.ack(0, 2);
  allgather_direct_rounds(c, 2);
}

}  // namespace plait
