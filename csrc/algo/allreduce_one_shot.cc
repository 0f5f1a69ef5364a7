// allreduce "one_shot": every rank stages its whole input, then reduces all stagings itself.
// Per chunk of up to half the staging area: 1 copy in, 1 flag, 1 wait for every peer, one
// n-way reduce. Each rank writes S bytes and reads n*S. Best for small messages, where the
// single synchronisation dominates. All ranks reduce in rank order, so the bytes agree.
// Messages that fit the transport's inline bytes (32 on shared memory) travel on the post line
// itself: one cache-line transfer per peer and call, no staging at all.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void allreduce_one_shot(Ctx& c) {
  Transport& tp = c.tp;
  const Slots slots(tp, 2);
  const int64_t chunk = c.elems_in(slots.bytes);
  const void* srcs[64];
  std::vector<const void*> many;
  const void** src = c.size <= 64 ? srcs : (many.resize(size_t(c.size)), many.data());
  const size_t bytes = size_t(c.a.count) * c.esize;
  if (c.fits_inline(bytes)) {
    std::memcpy(tp.inline_slot(c.rank), c.a.in, bytes);
    tp.post(0, 1);
    tp.wait_post_all(0, 1);
    for (int p = 0; p < c.size; ++p) src[p] = tp.inline_slot(p);
    c.reduce(c.a.out, src, c.size, c.a.count, true);
    return;
  }
  int64_t step = 0;
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const int64_t n = std::min(chunk, c.a.count - off);
    ++step;
    const size_t slot = slots.offset(step);
    tp.wait_ack_all(0, step - slots.count());
    std::memcpy(tp.staging(c.rank) + slot, c.in_at(off), size_t(n) * c.esize);
    tp.post(0, step);
    tp.wait_post_all(0, step);
    for (int p = 0; p < c.size; ++p) src[p] = tp.staging(p) + slot;
    c.reduce(c.out_at(off), src, c.size, n, true);
    tp.ack(0, step);
  }
}

}  // namespace plait
