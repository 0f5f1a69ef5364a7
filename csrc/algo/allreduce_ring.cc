// allreduce "ring": reduce-scatter then allgather around the ring r -> r+1, chunked and
// pipelined so that any message streams through a fixed staging area.
// Per round the chunk is cut into n blocks; hop h < n-1 forwards the partial sum of block
// (r-h) mod n and folds the left neighbour's partial of block (r-h-1) into this rank's input;
// after n-1 hops rank r owns the finished block (r+1) mod n, and n-1 more hops pass the finished
// blocks on. 2(n-1) synchronisations per round, each with one neighbour; each rank sends
// 2(n-1)/n*S. Each finished block is computed once and copied, so all ranks get the same bytes.
// Hops 1..n-2 carry partials (reduce.h): float32 for the half types, which round once, in the hop
// that finishes a block, like one_shot; those hops move twice the bytes of the half elements, so
// a slot holds half as many of them when n > 2.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void allreduce_ring(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Ring ring(r, n);
  const Slots slots(tp, 4);
  const int64_t block = c.elems_in(slots.bytes, n > 2 ? c.psize : c.esize);
  const int64_t chunk = block * n;
  int64_t step = 0;  // one step per hop
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const int64_t len = std::min(chunk, c.a.count - off);
    auto blk = [&](int b, int64_t* lo) {
      b = ((b % n) + n) % n;
      *lo = off + part_begin(len, n, b);
      return part_begin(len, n, b + 1) - part_begin(len, n, b);
    };
    int64_t lo;
    // Hop 0 sends this rank's own input block r.
    int64_t cnt = blk(r, &lo);
    ++step;
    tp.wait_ack(ring.right, 0, step - slots.count());
    std::memcpy(slots.at(r, step), c.in_at(lo), size_t(cnt) * c.esize);
    tp.post(0, step);
    for (int h = 0; h < 2 * n - 2; ++h) {
      // Receive what the left neighbour sent at this hop: block (r - h - 1).
      cnt = blk(r - h - 1, &lo);
      tp.wait_post(ring.left, 0, step);
      const char* got = slots.at(ring.left, step);
      const bool last = h == 2 * n - 3;
      if (!last) tp.wait_ack(ring.right, 0, step + 1 - slots.count());
      char* fwd = last ? nullptr : slots.at(r, step + 1);
      if (h < n - 1) {
        const void* src[2] = {got, c.in_at(lo)};
        const bool finished = h == n - 2;
        // Hop 0 brought the left neighbour's input as is; later hops bring its partials.
        c.reduce(fwd, src, 2, cnt, finished, h > 0 ? 1u : 0u, !finished);
        if (finished) std::memcpy(c.out_at(lo), fwd, size_t(cnt) * c.esize);
      } else {
        std::memcpy(c.out_at(lo), got, size_t(cnt) * c.esize);
        if (fwd) std::memcpy(fwd, got, size_t(cnt) * c.esize);
      }
      tp.ack(0, step);
      if (!last) tp.post(0, ++step);
    }
  }
}

}  // namespace plait
