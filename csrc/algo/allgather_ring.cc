// allgather "ring", scheduled by ring_plan (algo/plan.h): hop h is the plan's allgather step h,
// passing its send block to the right neighbour, which keeps a copy and forwards it. n-1
// synchronisations per piece, one neighbour each; each rank sends (n-1)/n*S and reads the same. In
// place when the input is this rank's block of the output.
#include <cstring>

#include "algo/plan.h"

namespace plait {

void allgather_ring(Ctx& c) {
  Transport& tp = c.tp;
  const int r = c.rank;
  const int n = c.size;
  const RingPlan plan = ring_plan(r, n);
  const Slots slots(tp, 4);
  const int64_t piece = c.elems_in(slots.bytes);
  const int64_t m = c.a.count;
  int64_t step = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    const size_t bytes = size_t(len) * c.esize;
    ++step;
    tp.wait_ack(plan.right, 0, step - slots.count());
    std::memcpy(slots.at(r, step), c.in_at(off), bytes);
    tp.post(0, step);
    char* own = c.out_at(plan.allgather[0].send_block * m + off);  // this rank's block
    if (own != c.in_at(off)) std::memcpy(own, c.in_at(off), bytes);
    for (int h = 0; h < n - 1; ++h) {
      tp.wait_post(plan.left, 0, step);
      const char* got = slots.at(plan.left, step);
      std::memcpy(c.out_at(plan.allgather[size_t(h)].recv_block * m + off), got, bytes);
      const bool last = h == n - 2;
      if (!last) {
        tp.wait_ack(plan.right, 0, step + 1 - slots.count());
        std::memcpy(slots.at(r, step + 1), got, bytes);
      }
      tp.ack(0, step);
      if (!last) tp.post(0, ++step);
    }
  }
}

}  // namespace plait
