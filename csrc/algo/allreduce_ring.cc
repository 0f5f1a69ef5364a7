// allreduce "ring": reduce-scatter then allgather around the ring r -> r+1, chunked and
// pipelined so that any message streams through a fixed staging area.
// Per round the chunk is cut into n blocks, scheduled by ring_plan (algo/plan.h, the schedule
// the GPU rings run too): hop h < n-1 is the plan's reduce-scatter step h, folding the left
// neighbour's partial of its receive block into this rank's input; after n-1 hops rank r owns
// the finished block r, and the plan's n-1 allgather steps pass the finished blocks on. 2(n-1)
// synchronisations per round, each with one neighbour; each rank sends 2(n-1)/n*S. Each finished
// block is computed once and copied, so all ranks get the same bytes. Hops 1..n-2 carry partials
// (reduce.h): float32 for the half types, which round once, in the hop that finishes a block, like
// one_shot; those hops move twice the bytes of the half elements, so a slot holds half as many of
// them when n > 2.
#include <cstring>

#include "algo/plan.h"

namespace plait {

void allreduce_ring(Ctx& c) { allreduce_ring_steps(c, 0); }

void allreduce_ring_steps(Ctx& c, int64_t first_step) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const RingPlan plan = ring_plan(r, n);
  // The block hop h receives: the plan's reduce-scatter steps, then its allgather steps.
  const auto recv_block = [&](int h) {
    return h < n - 1 ? plan.reduce_scatter[size_t(h)].recv_block
                     : plan.allgather[size_t(h - (n - 1))].recv_block;
  };
  const Slots slots(tp, 4);
  const int64_t block = c.elems_in(slots.bytes, n > 2 ? c.psize : c.esize);
  const int64_t chunk = block * n;
  int64_t step = first_step;  // one step per hop
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const int64_t len = std::min(chunk, c.a.count - off);
    auto blk = [&](int b, int64_t* lo) {
      *lo = off + part_begin(len, n, b);
      return part_begin(len, n, b + 1) - part_begin(len, n, b);
    };
    int64_t lo;
    // Hop 0 sends this rank's own input of the plan's first send block.
    int64_t cnt = blk(plan.reduce_scatter[0].send_block, &lo);
    ++step;
    tp.wait_ack(plan.right, 0, step - slots.count());
    std::memcpy(slots.at(r, step), c.in_at(lo), size_t(cnt) * c.esize);
    tp.post(0, step);
    for (int h = 0; h < 2 * n - 2; ++h) {
      // Receive what the left neighbour sent at this hop.
      cnt = blk(recv_block(h), &lo);
      tp.wait_post(plan.left, 0, step);
      const char* got = slots.at(plan.left, step);
      const bool last = h == 2 * n - 3;
      if (!last) tp.wait_ack(plan.right, 0, step + 1 - slots.count());
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
