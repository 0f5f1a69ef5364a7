// reduce_scatter "ring": the first half of the ring allreduce, scheduled by ring_plan
// (algo/plan.h): hop h is the plan's reduce-scatter step h, forwarding the partial sum of its send
// block to the right; after n-1 hops rank r holds the finished block r. Blocks are streamed in
// pieces that fit a slot. n-1 synchronisations per piece, one neighbour each; each rank sends
// (n-1)/n*S. Hops 1..n-2 carry partials (float32 for the half types, see reduce.h), so the finished
// block is rounded once; a slot holds half as many half elements when n > 2.
#include <cstring>

#include "algo/plan.h"

namespace plait {

void reduce_scatter_ring(Ctx& c) {
  Transport& tp = c.tp;
  const int r = c.rank;
  const int n = c.size;
  const RingPlan plan = ring_plan(r, n);
  const Slots slots(tp, 4);
  const int64_t piece = c.elems_in(slots.bytes, c.size > 2 ? c.psize : c.esize);
  const int64_t m = c.a.count;
  int64_t step = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    ++step;
    tp.wait_ack(plan.right, 0, step - slots.count());
    std::memcpy(slots.at(r, step), c.in_at(plan.reduce_scatter[0].send_block * m + off),
                size_t(len) * c.esize);
    tp.post(0, step);
    for (int h = 0; h < n - 1; ++h) {
      tp.wait_post(plan.left, 0, step);
      const bool last = h == n - 2;
      const void* src[2] = {slots.at(plan.left, step),
                            c.in_at(plan.reduce_scatter[size_t(h)].recv_block * m + off)};
      const uint32_t got_partials = h > 0 ? 1u : 0u;  // hop 0 sent the left neighbour's input as is
      if (last) {
        c.reduce(c.out_at(off), src, 2, len, true, got_partials);
      } else {
        tp.wait_ack(plan.right, 0, step + 1 - slots.count());
        c.reduce(slots.at(r, step + 1), src, 2, len, false, got_partials, true);
      }
      tp.ack(0, step);
      if (!last) tp.post(0, ++step);
    }
  }
}

}  // namespace plait
