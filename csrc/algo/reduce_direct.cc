// reduce "direct": every rank but the root stages each chunk; the root reduces the n inputs
// (its own read in place) straight into its output. One synchronisation per chunk; non-roots
// write S, the root reads n*S. The root reduces in rank order, like every allreduce.
#include <cstring>
#include <vector>

#include "algo/algo.h"

namespace plait {

void reduce_direct(Ctx& c) {
  Transport& tp = c.tp;
  const int root = c.a.root, n = c.size;
  const Slots slots(tp, 2);
  const int64_t chunk = c.elems_in(slots.bytes);
  std::vector<const void*> src(static_cast<size_t>(n));
  if (c.fits_inline(size_t(c.a.count) * c.esize)) {  // inputs ride the post lines
    if (c.rank != root) {
      std::memcpy(tp.inline_slot(c.rank), c.a.in, size_t(c.a.count) * c.esize);
      tp.post(0, 1);
      return;
    }
    tp.wait_post_all(0, 1);
    for (int p = 0; p < n; ++p)
      src[size_t(p)] = p == root ? static_cast<const void*>(c.a.in) : tp.inline_slot(p);
    c.reduce(c.a.out, src.data(), n, c.a.count, true);
    return;
  }
  int64_t step = 0;
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const int64_t len = std::min(chunk, c.a.count - off);
    ++step;
    const size_t slot = slots.offset(step);
    if (c.rank != root) {
      tp.wait_ack(root, 0, step - slots.count());
      std::memcpy(tp.staging(c.rank) + slot, c.in_at(off), size_t(len) * c.esize);
      tp.post(0, step);
    } else {
      for (int p = 0; p < n; ++p) {
        if (p != root) tp.wait_post(p, 0, step);
        src[size_t(p)] = p == root ? static_cast<const void*>(c.in_at(off)) : tp.staging(p) + slot;
      }
      c.reduce(c.out_at(off), src.data(), n, len, true);
      tp.ack(0, step);
    }
  }
}

}  // namespace plait
