#include "algo/plan.h"

#include "core/errors.h"

namespace plait {

std::vector<Span> chunk_plan(int64_t count, int64_t chunk_elems) {
  if (count < 0 || chunk_elems < 1)
    throw InvalidArgument("chunk_plan: count " + std::to_string(count) + " and chunk " +
                          std::to_string(chunk_elems) + " must be >= 0 and >= 1");
  std::vector<Span> out;
  out.reserve(size_t((count + chunk_elems - 1) / chunk_elems));
  for (int64_t off = 0; off < count; off += chunk_elems)
    out.push_back({off, count - off < chunk_elems ? count - off : chunk_elems});
  return out;
}

int64_t aligned_part_begin(int64_t count, int n, int q, int64_t align) {
  if (n < 1 || q < 0 || q > n || count < 0 || align < 1)
    throw InvalidArgument("aligned_part_begin: part " + std::to_string(q) + " of " +
                          std::to_string(n) + ", count " + std::to_string(count) + ", alignment " +
                          std::to_string(align));
  const int64_t lo = part_begin(count, n, q), up = (lo + align - 1) / align * align;
  return up < count ? up : count;
}

RingPlan ring_plan(int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n)
    throw InvalidArgument("ring_plan: rank " + std::to_string(rank) + " is not in a ring of " +
                          std::to_string(n));
  const auto mod = [n](int b) { return ((b % n) + n) % n; };
  RingPlan p;
  p.left = mod(rank - 1);
  p.right = mod(rank + 1);
  for (int s = 0; s + 1 < n; ++s) {
    p.reduce_scatter.push_back({mod(rank - s - 1), mod(rank - s - 2)});
    p.allgather.push_back({mod(rank - s), mod(rank - s - 1)});
  }
  return p;
}

std::vector<IpcRingStep> ipc_ring_plan(Coll coll, int rank, int n, int64_t count,
                                       int64_t slot_elems) {
  const RingPlan p = ring_plan(rank, n);
  if (coll != Coll::allreduce && coll != Coll::reduce_scatter && coll != Coll::allgather)
    throw InvalidArgument(std::string("ipc_ring_plan: no ring for ") + coll_name(coll));
  if (slot_elems < 1 || slot_elems > INT64_MAX / n)
    throw InvalidArgument("ipc_ring_plan: slot of " + std::to_string(slot_elems) +
                          " elements is out of range");
  std::vector<IpcRingStep> steps;
  if (n == 1) return steps;
  int64_t epoch = 0;  // the last one this rank posted
  const auto step = [&](IpcRingStep::Kind kind, int b, int64_t in, int64_t out, int64_t m,
                        bool reads, bool posts) {
    steps.push_back({kind, b, in, out, m, reads ? epoch : 0, posts ? epoch + 1 : 0});
    if (posts) ++epoch;
  };
  const int last = n - 2;  // the last step of ring_plan's reduce-scatter and allgather
  if (coll == Coll::allreduce) {
    for (const Span& r : chunk_plan(count, slot_elems * n)) {
      const auto at = [&](int b, IpcRingStep::Kind kind, bool reads, bool posts) {
        const int64_t lo = part_begin(r.count, n, b), hi = part_begin(r.count, n, b + 1);
        step(kind, b, r.offset + lo, r.offset + lo, hi - lo, reads, posts);
      };
      at(p.reduce_scatter[0].send_block, IpcRingStep::load, false, true);
      for (int s = 0; s <= last; ++s)
        at(p.reduce_scatter[size_t(s)].recv_block,
           s == last ? IpcRingStep::finish : IpcRingStep::reduce, true, true);
      for (int s = 0; s <= last; ++s)
        at(p.allgather[size_t(s)].recv_block, IpcRingStep::gather, true, s < last);
    }
    return steps;
  }
  for (const Span& w : chunk_plan(count, slot_elems)) {
    if (coll == Coll::reduce_scatter) {
      const int first = p.reduce_scatter[0].send_block;
      step(IpcRingStep::load, first, first * count + w.offset, 0, w.count, false, true);
      for (int s = 0; s <= last; ++s) {
        const int b = p.reduce_scatter[size_t(s)].recv_block;
        step(s == last ? IpcRingStep::finish : IpcRingStep::reduce, b, b * count + w.offset,
             w.offset, w.count, true, s < last);
      }
    } else {
      step(IpcRingStep::load, rank, w.offset, rank * count + w.offset, w.count, false, true);
      for (int s = 0; s <= last; ++s) {
        const int b = p.allgather[size_t(s)].recv_block;
        step(IpcRingStep::gather, b, 0, b * count + w.offset, w.count, true, s < last);
      }
    }
  }
  return steps;
}

TreeLinks tree_links(int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n)
    throw InvalidArgument("tree_links: rank " + std::to_string(rank) + " is not in a tree of " +
                          std::to_string(n));
  TreeLinks t;
  t.parent = rank == 0 ? -1 : (rank - 1) / 2;
  for (int c = 2 * rank + 1; c <= 2 * rank + 2 && c < n; ++c) t.children.push_back(c);
  return t;
}

}  // namespace plait
