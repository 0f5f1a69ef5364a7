// allreduce "tree": reduce up a binary tree rooted at rank 0 (tree_links in algo/plan.h, the tree
// the GPU tree runs too: children of r are 2r+1, 2r+2), then
// broadcast the result down it, chunk by chunk with the two phases overlapped (the down phase
// trails the up phase by kLag chunks). A node waits for at most 3 peers per chunk and phase, so
// latency grows with log2(n) rather than n; each rank moves about 3S. Rank 0 computes every
// finished value once and it is copied down, so all ranks get the same bytes.
// Channel 0 carries partial sums up (slots in the sender's "up" area), channel 1 finished
// chunks down (slots in the sender's "down" area). A leaf sends its input up as is; an inner node
// other than the root sends partials (float32 for the half types, see reduce.h), so the root
// rounds each value once. Inner non-root nodes exist from 4 ranks on; then an up slot holds half
// as many half elements.
#include <cstring>

#include "algo/plan.h"

namespace plait {

void allreduce_tree(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const TreeLinks links = tree_links(r, n);
  const int parent = links.parent;
  const std::vector<int>& kids = links.children;
  const int nkids = int(kids.size());
  constexpr int kSlots = 4, kLag = 2;
  const size_t slot_bytes = tp.staging_bytes() / (2 * kSlots);
  const int64_t chunk = c.elems_in(slot_bytes, n > 3 ? c.psize : c.esize);
  uint32_t kid_partials = 0;  // bit k + 1: kid k is an inner node, so it sends partials
  for (int k = 0; k < nkids; ++k)
    if (2 * kids[k] + 1 < n) kid_partials |= 1u << (k + 1);
  const int64_t nchunks = (c.a.count + chunk - 1) / chunk;
  auto up = [&](int rank, int64_t i) { return tp.staging(rank) + size_t(i % kSlots) * slot_bytes; };
  auto down = [&](int rank, int64_t i) {
    return tp.staging(rank) + size_t(kSlots + i % kSlots) * slot_bytes;
  };
  auto span = [&](int64_t i, int64_t* off) {
    *off = i * chunk;
    return std::min(chunk, c.a.count - *off);
  };
  for (int64_t it = 0; it < nchunks + kLag; ++it) {
    if (it < nchunks) {  // up phase of chunk it; steps are chunk index + 1
      int64_t off;
      const int64_t len = span(it, &off);
      const void* src[3] = {c.in_at(off), nullptr, nullptr};
      for (int k = 0; k < nkids; ++k) {
        tp.wait_post(kids[k], 0, it + 1);
        src[k + 1] = up(kids[k], it);
      }
      char* dst;
      if (parent >= 0) {
        tp.wait_ack(parent, 0, it + 1 - kSlots);
        dst = up(r, it);
      } else {
        for (int k = 0; k < nkids; ++k) tp.wait_ack(kids[k], 1, it + 1 - kSlots);
        dst = down(r, it);
      }
      c.reduce(dst, src, 1 + nkids, len, parent < 0, kid_partials, parent >= 0 && nkids > 0);
      if (nkids) tp.ack(0, it + 1);
      if (parent >= 0) {
        tp.post(0, it + 1);
      } else {
        std::memcpy(c.out_at(off), dst, size_t(len) * c.esize);
        tp.post(1, it + 1);
      }
    }
    const int64_t j = it - kLag;
    if (parent >= 0 && j >= 0) {  // down phase of chunk j
      int64_t off;
      const int64_t len = span(j, &off);
      tp.wait_post(parent, 1, j + 1);
      const char* got = down(parent, j);
      if (nkids) {
        for (int k = 0; k < nkids; ++k) tp.wait_ack(kids[k], 1, j + 1 - kSlots);
        std::memcpy(down(r, j), got, size_t(len) * c.esize);
        tp.post(1, j + 1);
      }
      std::memcpy(c.out_at(off), got, size_t(len) * c.esize);
      tp.ack(1, j + 1);
    }
  }
}

}  // namespace plait
