// reduce_scatter "direct": each rank stages, for every peer q, the piece of block q that q
// reduces; then reduces its own block from the n stagings (its own input read in place) straight
// into the output. One synchronisation per chunk; each rank writes (n-1)/n*S and reads S.
// Input is n blocks of `count` elements; block q's result lands on rank q.
#include <cstring>
#include <vector>

#include "algo/algo.h"

namespace plait {

void reduce_scatter_direct(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Slots slots(tp, 2);
  const int64_t piece = c.elems_in(slots.bytes / size_t(n));
  const int64_t m = c.a.count;
  std::vector<const void*> src(static_cast<size_t>(n));
  if (c.fits_inline(size_t(n * m) * c.esize)) {  // the whole input rides the post line
    std::memcpy(tp.inline_slot(r), c.a.in, size_t(n * m) * c.esize);
    tp.post(0, 1);
    tp.wait_post_all(0, 1);
    for (int p = 0; p < n; ++p)
      src[size_t(p)] = p == r ? static_cast<const void*>(c.in_at(int64_t(r) * m))
                              : tp.inline_slot(p) + size_t(r * m) * c.esize;
    c.reduce(c.a.out, src.data(), n, m, true);
    return;
  }
  int64_t round = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    ++round;
    const size_t slot = slots.offset(round);
    tp.wait_ack_all(0, round - slots.count());
    for (int q = 0; q < n; ++q)
      if (q != r)
        std::memcpy(tp.staging(r) + slot + size_t(q) * size_t(piece) * c.esize,
                    c.in_at(int64_t(q) * m + off), size_t(len) * c.esize);
    tp.post(0, round);
    tp.wait_post_all(0, round);
    for (int p = 0; p < n; ++p)
      src[size_t(p)] = p == r ? static_cast<const void*>(c.in_at(int64_t(r) * m + off))
                              : tp.staging(p) + slot + size_t(r) * size_t(piece) * c.esize;
    c.reduce(c.out_at(off), src.data(), n, len, true);
    tp.ack(0, round);
  }
}

}  // namespace plait
