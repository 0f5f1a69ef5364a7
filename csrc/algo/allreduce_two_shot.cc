// allreduce "two_shot": a reduce-scatter and an allgather through shared memory.
// Per chunk: each rank stages the n-1 parts of its input that peers reduce (not its own part),
// posts, reduces its own part from the n inputs (its own read in place) into a result area,
// posts again, then copies every part's result into its output. Two synchronisations per chunk;
// each rank moves ~(n-1)/n*S in, reads S to reduce, writes S/n, copies S out: about 8S of memory
// traffic per rank at n=2 against 11S for copy-in/reduce/copy-out. One rank owns each part's
// arithmetic, so all ranks get the same bytes.
#include <cstring>
#include <vector>

#include "algo/algo.h"

namespace plait {

void allreduce_two_shot(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Slots slots(tp, 2);
  // A slot holds the chunk's parts for peers plus this rank's reduced part (at most chunk/n + 1).
  int64_t chunk = c.elems_in((slots.bytes - 128) / size_t(n + 1) * size_t(n));
  const size_t result_off = (size_t(chunk) * c.esize + 63) / 64 * 64;
  std::vector<const void*> src(static_cast<size_t>(n));
  int64_t round = 0;
  for (int64_t off = 0; off < c.a.count; off += chunk) {
    const int64_t len = std::min(chunk, c.a.count - off);
    ++round;
    const size_t slot = slots.offset(round);
    char* mine = tp.staging(r) + slot;
    tp.wait_ack_all(0, round - slots.count());
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const int64_t b = part_begin(len, n, q), e = part_begin(len, n, q + 1);
      std::memcpy(mine + size_t(b) * c.esize, c.in_at(off + b), size_t(e - b) * c.esize);
    }
    tp.post(0, round);
    const int64_t b = part_begin(len, n, r), e = part_begin(len, n, r + 1);
    tp.wait_post_all(0, round);
    for (int p = 0; p < n; ++p)
      src[size_t(p)] = p == r ? static_cast<const void*>(c.in_at(off + b))
                              : tp.staging(p) + slot + size_t(b) * c.esize;
    tp.wait_ack_all(1, round - slots.count());
    c.reduce(mine + result_off, src.data(), n, e - b, true);
    tp.ack(0, round);
    tp.post(1, round);
    tp.wait_post_all(1, round);
    for (int p = 0; p < n; ++p) {
      const int64_t pb = part_begin(len, n, p), pe = part_begin(len, n, p + 1);
      std::memcpy(c.out_at(off + pb), tp.staging(p) + slot + result_off, size_t(pe - pb) * c.esize);
    }
    tp.ack(1, round);
  }
}

}  // namespace plait
