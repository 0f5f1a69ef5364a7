#include "algo/gpu_plan.h"

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

RingPlan ring_plan(int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n)
    throw InvalidArgument("ring_plan: rank " + std::to_string(rank) + " is not in a ring of " + std::to_string(n));
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

TreeLinks tree_links(int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n)
    throw InvalidArgument("tree_links: rank " + std::to_string(rank) + " is not in a tree of " + std::to_string(n));
  TreeLinks t;
  t.parent = rank == 0 ? -1 : (rank - 1) / 2;
  for (int c = 2 * rank + 1; c <= 2 * rank + 2 && c < n; ++c) t.children.push_back(c);
  return t;
}

}  // namespace plait
