// allgather "single_copy": every rank reads each peer's input straight from the peer's memory
// into its output (Transport::read_peer, a kernel copy between address spaces). Each rank
// moves S bytes once, with no staging copy; the only synchronisations are "my addresses are
// published" and "I am done reading you". In place when the input is this rank's block of the
// output: peers read that block while this rank writes only the others.

#include <cstring>

#include "algo/algo.h"
#include "transport/shared_mem.h"

namespace plait {

void allgather_single_copy(Ctx& c) {
  c.tp.expose(c.a.in, c.a.out);
  c.tp.post(0, 1);
  allgather_single_copy_exposed(c);
}

void allgather_single_copy_exposed(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const size_t bytes = size_t(c.a.count) * c.esize;
  char* own = c.out_at(int64_t(r) * c.a.count);
  // Nothing here re-reads the gathered output: when it is too big to stay cached anyway
  // (kGatherStreamMin) this rank's block bypasses the cache (no read for ownership first).
  if (own != c.in_at(0)) {
    if (bytes * size_t(n) >= kGatherStreamMin)
      stream_copy(own, c.in_at(0), bytes);
    else
      std::memcpy(own, c.in_at(0), bytes);
  }
  for (int i = 1; i < n; ++i) {
    const int p = (r + i) % n;  // start with different peers so readers spread out
    tp.wait_post(p, 0, 1);
    tp.read_peer(p, c.out_at(int64_t(p) * c.a.count), tp.peer_in(p), bytes);
  }
  tp.ack(0, 1);           // done reading every peer
  tp.wait_ack_all(0, 1);  // and every peer is done reading this rank's input
}

}  // namespace plait
