// allreduce "single_copy": a reduce-scatter and an allgather that read peers' buffers directly
// (Transport::read_peer) instead of staging them. Rank r owns part r: per L2-sized chunk it reads
// each peer's piece of part r from the peer's input into scratch, reduces all n pieces in rank
// order straight into its output and posts the chunk; then it reads the chunk of the same round
// of every peer's part from that peer's output, while the peer's caches still hold it.
// Per rank: (n-1)/n*S read from peers for the reduction, S/n written, (n-1)/n*S copied back in;
// nothing goes through staging, so at two ranks it moves about 5-6S of memory against ~8S for
// the best staged scheme. One rank computes each element, so all ranks get the same bytes.
//
// In place (out == in) is safe: a peer reads part p of this rank's input only until it posts
// the chunk, and this rank overwrites that chunk only after seeing the post.
#include <vector>

#include "algo/algo.h"

namespace plait {

void allreduce_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int64_t count = c.a.count;
  tp.expose(c.a.in, c.a.out);
  tp.post(0, 1);
  const int64_t chunk = std::max<int64_t>(1, c.elems_in(kSingleCopyScratch / size_t(n - 1)));
  const int64_t mine_lo = part_begin(count, n, r), mine_hi = part_begin(count, n, r + 1);
  int64_t rounds = 0;
  for (int q = 0; q < n; ++q) {
    const int64_t len = part_begin(count, n, q + 1) - part_begin(count, n, q);
    rounds = std::max(rounds, (len + chunk - 1) / chunk);
  }
  char* tmp = scratch(size_t(n - 1) * size_t(chunk) * c.esize);
  std::vector<const void*> src(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) tp.wait_post(p, 0, 1);
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t lo = mine_lo + k * chunk;
    if (lo < mine_hi) {
      const int64_t len = std::min(chunk, mine_hi - lo);
      const size_t stride = size_t(chunk) * c.esize;
      int slot = 0;
      for (int i = 0; i < n; ++i) {
        const int p = (r + i) % n;
        if (p == r) {
          src[size_t(p)] = c.in_at(lo);
        } else {
          char* t = tmp + size_t(slot++) * stride;
          tp.read_peer(p, t, tp.peer_in(p) + size_t(lo) * c.esize, size_t(len) * c.esize);
          src[size_t(p)] = t;
        }
      }
      c.reduce(c.out_at(lo), src.data(), n, len, true);
      tp.post(1, k + 1);
    }
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      const int64_t plo = part_begin(count, n, p) + k * chunk, phi = part_begin(count, n, p + 1);
      if (plo >= phi) continue;
      tp.wait_post(p, 1, k + 1);
      tp.read_peer(p, c.out_at(plo), tp.peer_out(p) + size_t(plo) * c.esize,
                   size_t(std::min(chunk, phi - plo)) * c.esize);
    }
  }
  tp.ack(0, 1);           // done reading every peer
  tp.wait_ack_all(0, 1);  // and every peer is done reading this rank
}

}  // namespace plait
