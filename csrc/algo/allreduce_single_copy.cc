// allreduce "single_copy": a reduce-scatter and an allgather through peers' own buffers, with no
// staging (Transport::read_peer / write_peer, kernel copies between address spaces).
// Rank r owns part r. Per L2-sized chunk it reads each peer's piece of part r from the peer's
// input into scratch, reduces the n pieces in rank order straight into its output, and writes
// the finished chunk into every peer's output while it is still in this core's cache.
// Per rank: (n-1)/n*S read from peers, S/n reduced, (n-1)/n*S written to peers, and only two
// synchronisations per call (addresses published; all reads and writes done). One rank computes
// each element, so all ranks get the same bytes.
//
// In place (out == in) is safe: part r of a peer's buffer is read only by rank r, and rank r
// writes a chunk of it only after reading that chunk; each rank writes only part r of others.
#include <vector>

#include "algo/algo.h"
#include "transport/shared_mem.h"

namespace plait {

void allreduce_single_copy(Ctx& c) {
  c.tp.expose(c.a.in, c.a.out);
  c.tp.post(0, 1);
  allreduce_single_copy_exposed(c);
}

void allreduce_single_copy_exposed(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int64_t chunk = std::max<int64_t>(1, c.elems_in(kSingleCopyScratch / size_t(n - 1)));
  const int64_t lo_end = part_begin(c.a.count, n, r + 1);
  // A peer's output that this rank maps (a plait shared buffer) is written with non-temporal
  // stores when large; process_vm_writev (private buffers) has no such choice.
  const bool stream_mapped = c.a.out != c.a.in && size_t(c.a.count) * c.esize >= kStreamOutMin;
  // Slots for n-1 peers' pieces.
  const size_t slot = size_t(chunk) * c.esize;
  char* tmp = scratch(size_t(n - 1) * slot);
  std::vector<const void*> src(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) tp.wait_post(p, 0, 1);
  for (int64_t lo = part_begin(c.a.count, n, r); lo < lo_end; lo += chunk) {
    const int64_t len = std::min(chunk, lo_end - lo);
    const size_t off = size_t(lo) * c.esize, bytes = size_t(len) * c.esize;
    // The chunk is reduced straight into this rank's output and pushed from there while it is
    // still in this core's cache. Out of place, reducing into scratch and streaming the chunk to
    // the output with non-temporal stores instead (the path from 8 MiB until 2026-12-04) was
    // slower at every size measured on the AMD EPYC VM (1 MiB L2, 32 MiB L3): 2-rank 8 MiB
    // 1.54 vs 1.32 ms, 16 MiB 3.1-3.3 vs 2.7 ms, 64 MiB 12.4-14.1 vs 10.2-11.4 ms (RESULTS.md).
    reduce_from_peers(c, c.out_at(lo), c.in_at(lo), off, len, tmp, slot, src);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      tp.write_peer(p, const_cast<char*>(tp.peer_out(p)) + off, c.out_at(lo), bytes, stream_mapped);
    }
  }
  tp.post(1, 1);           // done reading and writing every peer
  tp.wait_post_all(1, 1);  // and every peer is done with this rank's buffers
}

}  // namespace plait
