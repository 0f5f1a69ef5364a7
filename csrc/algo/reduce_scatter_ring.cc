// reduce_scatter "ring": the first half of the ring allreduce. Hop h forwards the partial sum of
// block (r-h-1) mod n to the right; after n-1 hops rank r holds the finished block r. Blocks are
// streamed in pieces that fit a slot. n-1 synchronisations per piece, one neighbour each; each
// rank sends (n-1)/n*S.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void reduce_scatter_ring(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int left = (r + n - 1) % n, right = (r + 1) % n;
  constexpr int kSlots = 4;
  const size_t slot_bytes = tp.staging_bytes() / kSlots;
  const int64_t piece = c.elems_in(slot_bytes);
  const int64_t m = c.a.count;
  auto slot = [&](int rank, int64_t s) { return tp.staging(rank) + size_t((s - 1) % kSlots) * slot_bytes; };
  auto blk = [&](int b) { return int64_t(((b % n) + n) % n) * m; };
  int64_t step = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    // Hop 0 sends block r-1, so that the last hop finishes block r here.
    ++step;
    tp.wait_ack(right, 0, step - kSlots);
    std::memcpy(slot(r, step), c.in_at(blk(r - 1) + off), size_t(len) * c.esize);
    tp.post(0, step);
    for (int h = 0; h < n - 1; ++h) {
      tp.wait_post(left, 0, step);
      const bool last = h == n - 2;
      const void* src[2] = {slot(left, step), c.in_at(blk(r - h - 2) + off)};
      if (last) {
        c.reduce(c.out_at(off), src, 2, len, true);
      } else {
        tp.wait_ack(right, 0, step + 1 - kSlots);
        c.reduce(slot(r, step + 1), src, 2, len, false);
      }
      tp.ack(0, step);
      if (!last) tp.post(0, ++step);
    }
  }
}

}  // namespace plait
