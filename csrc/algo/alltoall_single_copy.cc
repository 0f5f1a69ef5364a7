// alltoall "single_copy": rank r reads block r of each peer's input straight from the peer's
// memory (Transport::read_peer) into block p of its output. Out of place that is one copy per
// block and no staging. In place (out is x), block p of this rank's buffer is what peer p still
// has to read, so the peers' blocks are read into private memory first and copied into the
// output only once every peer has said it is done reading this rank.
#include <cstring>
#include <memory>

#include "algo/algo.h"

namespace plait {

void alltoall_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int64_t m = c.a.count;  // elements per block
  const size_t bytes = size_t(m) * c.esize;
  const bool in_place = c.a.out == c.a.in;
  tp.expose(c.a.in, c.a.out);
  tp.post(0, 1);
  std::unique_ptr<char[]> held(in_place && bytes ? new char[size_t(n) * bytes] : nullptr);
  auto dest = [&](int p) {
    return in_place ? held.get() + size_t(p) * bytes : c.out_at(int64_t(p) * m);
  };
  if (!in_place && bytes) std::memcpy(dest(r), c.in_at(int64_t(r) * m), bytes);
  for (int i = 1; i < n; ++i) {
    const int p = (r + i) % n;  // start with different peers so readers spread out
    tp.wait_post(p, 0, 1);
    tp.read_peer(p, dest(p), tp.peer_in(p) + size_t(r) * bytes, bytes);
  }
  tp.ack(0, 1);           // done reading every peer
  tp.wait_ack_all(0, 1);  // and every peer is done reading this rank
  if (in_place && bytes)
    for (int p = 0; p < n; ++p)
      if (p != r) std::memcpy(c.out_at(int64_t(p) * m), dest(p), bytes);
}

}  // namespace plait
