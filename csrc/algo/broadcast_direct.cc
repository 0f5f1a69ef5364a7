// broadcast "direct": the root stages each chunk once and every other rank copies it out.
// One synchronisation per chunk (root -> all, acks back for slot reuse); the root writes S,
// each other rank reads S. The root's output, when distinct from its input, gets a plain copy.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void broadcast_direct(Ctx& c) {
  Transport& tp = c.tp;
  const int root = c.a.root;
  const Slots slots(tp, 2);
  const int64_t chunk = c.elems_in(slots.bytes);
  const size_t total = size_t(c.a.count) * c.esize;
  if (c.fits_inline(total)) {  // the root's data rides its post line
    if (c.rank == root) {
      std::memcpy(tp.inline_slot(root), c.a.in, total);
      tp.post(0, 1);
      if (c.a.out != c.a.in) std::memcpy(c.a.out, c.a.in, total);
    } else {
      tp.wait_post(root, 0, 1);
      std::memcpy(c.a.out, tp.inline_slot(root), total);
    }
    return;
  }
  int64_t step = 0;
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const size_t bytes = size_t(std::min(chunk, c.a.count - off)) * c.esize;
    ++step;
    const size_t slot = slots.offset(step);
    if (c.rank == root) {
      tp.wait_ack_all(0, step - slots.count());
      std::memcpy(tp.staging(root) + slot, c.in_at(off), bytes);
      tp.post(0, step);
      if (c.out_at(off) != c.in_at(off)) std::memcpy(c.out_at(off), c.in_at(off), bytes);
    } else {
      tp.wait_post(root, 0, step);
      std::memcpy(c.out_at(off), tp.staging(root) + slot, bytes);
      tp.ack(0, step);
    }
  }
}

}  // namespace plait
