// alltoall "direct": each rank stages, for every peer q, the piece of block q meant for q; then
// copies its piece out of every peer's staging. One synchronisation per chunk; each rank writes
// and reads (n-1)/n*S. In place (output == input) is safe: a round stages every block's piece
// before it overwrites any of them.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void alltoall_direct(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Slots slots(tp, 2);
  const int64_t piece = c.elems_in(slots.bytes / size_t(n));
  const int64_t m = c.a.count;
  if (c.fits_inline(size_t(n * m) * c.esize)) {  // the whole input rides the post line
    const size_t bytes = size_t(m) * c.esize;
    std::memcpy(tp.inline_slot(r), c.a.in, size_t(n) * bytes);
    tp.post(0, 1);
    char* own = c.out_at(int64_t(r) * m);
    if (own != c.in_at(int64_t(r) * m)) std::memcpy(own, c.in_at(int64_t(r) * m), bytes);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      tp.wait_post(p, 0, 1);
      std::memcpy(c.out_at(int64_t(p) * m), tp.inline_slot(p) + size_t(r) * bytes, bytes);
    }
    return;
  }
  int64_t round = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const size_t bytes = size_t(std::min(piece, m - off)) * c.esize;
    ++round;
    const size_t slot = slots.offset(round);
    const size_t stride = size_t(piece) * c.esize;
    tp.wait_ack_all(0, round - slots.count());
    for (int q = 0; q < n; ++q)
      if (q != r)
        std::memcpy(tp.staging(r) + slot + size_t(q) * stride, c.in_at(int64_t(q) * m + off),
                    bytes);
    tp.post(0, round);
    char* own = c.out_at(int64_t(r) * m + off);
    if (own != c.in_at(int64_t(r) * m + off))
      std::memmove(own, c.in_at(int64_t(r) * m + off), bytes);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      tp.wait_post(p, 0, round);
      std::memcpy(c.out_at(int64_t(p) * m + off), tp.staging(p) + slot + size_t(r) * stride, bytes);
    }
    tp.ack(0, round);
  }
}

}  // namespace plait
