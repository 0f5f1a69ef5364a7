// allgather "direct": each rank stages its input piece, then copies every peer's piece straight
// from its staging. One synchronisation per chunk; each rank writes S/n and reads S.
// In place when the input is this rank's block of the output (then nothing is copied for it).
#include <cstring>

#include "algo/algo.h"

namespace plait {

void allgather_direct(Ctx& c) { allgather_direct_rounds(c, 0); }

void allgather_direct_rounds(Ctx& c, int64_t first_round) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Slots slots(tp, 2);
  const int64_t piece = c.elems_in(slots.bytes);
  const int64_t m = c.a.count;
  if (first_round == 0 && c.fits_inline(size_t(m) * c.esize)) {  // the input rides the post line
    const size_t bytes = size_t(m) * c.esize;
    std::memcpy(tp.inline_slot(r), c.a.in, bytes);
    tp.post(0, 1);
    char* own = c.out_at(int64_t(r) * m);
    if (own != c.in_at(0)) std::memcpy(own, c.in_at(0), bytes);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;
      tp.wait_post(p, 0, 1);
      std::memcpy(c.out_at(int64_t(p) * m), tp.inline_slot(p), bytes);
    }
    return;
  }
  int64_t round = first_round;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    const size_t bytes = size_t(len) * c.esize;
    ++round;
    const size_t slot = slots.offset(round);
    tp.wait_ack_all(0, round - slots.count());
    std::memcpy(tp.staging(r) + slot, c.in_at(off), bytes);
    tp.post(0, round);
    char* own = c.out_at(int64_t(r) * m + off);
    if (own != c.in_at(off)) std::memcpy(own, c.in_at(off), bytes);
    for (int i = 1; i < n; ++i) {
      const int p = (r + i) % n;  // start with different peers so readers spread out
      tp.wait_post(p, 0, round);
      std::memcpy(c.out_at(int64_t(p) * m + off), tp.staging(p) + slot, bytes);
    }
    tp.ack(0, round);
  }
}

}  // namespace plait
