// allgather "ring": hop h passes block (r-h) mod n to the right neighbour, which keeps a copy
// and forwards it. n-1 synchronisations per piece, one neighbour each; each rank sends
// (n-1)/n*S and reads the same. In place when the input is this rank's block of the output.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void allgather_ring(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int left = (r + n - 1) % n, right = (r + 1) % n;
  constexpr int kSlots = 4;
  const size_t slot_bytes = tp.staging_bytes() / kSlots;
  const int64_t piece = c.elems_in(slot_bytes);
  const int64_t m = c.a.count;
  auto slot = [&](int rank, int64_t s) { return tp.staging(rank) + size_t((s - 1) % kSlots) * slot_bytes; };
  auto blk = [&](int b) { return int64_t(((b % n) + n) % n) * m; };
  int64_t step = 0;
  for (int64_t off = 0; off < m; off += piece) {
    const int64_t len = std::min(piece, m - off);
    const size_t bytes = size_t(len) * c.esize;
    ++step;
    tp.wait_ack(right, 0, step - kSlots);
    std::memcpy(slot(r, step), c.in_at(off), bytes);
    tp.post(0, step);
    char* own = c.out_at(blk(r) + off);
    if (own != c.in_at(off)) std::memcpy(own, c.in_at(off), bytes);
    for (int h = 0; h < n - 1; ++h) {
      tp.wait_post(left, 0, step);
      const char* got = slot(left, step);
      std::memcpy(c.out_at(blk(r - h - 1) + off), got, bytes);
      const bool last = h == n - 2;
      if (!last) {
        tp.wait_ack(right, 0, step + 1 - kSlots);
        std::memcpy(slot(r, step + 1), got, bytes);
      }
      tp.ack(0, step);
      if (!last) tp.post(0, ++step);
    }
  }
}

}  // namespace plait
