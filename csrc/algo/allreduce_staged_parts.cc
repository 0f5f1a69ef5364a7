// allreduce "staged_parts": a reduce-scatter and an allgather through shared memory that stage
// only what peers need, for large private (non-shared) buffers.
// Per round (a chunk that fills one of two staging slots, a quarter of buffer_bytes, cut into n
// parts; rank q owns part q): a rank copies the n-1 parts of its input that peers reduce into the
// same places of its staging and posts; reduces its own part from its own input, read in place,
// and the peers' staged copies of that part, straight into its output, then copies the finished
// part into its staging (at its own part's place, which it never staged) and posts again; last
// it copies every peer's finished part from the peer's staging into its output. It stages round
// k+1 before waiting for round k's results, so a peer still reducing is waited for while this
// rank copies.
// Two synchronisations per round. Per rank, of S bytes: (n-1)/n*S staged, S/n reduced from n
// sources, S/n copied to staging, (n-1)/n*S copied out: at n = 2 about 4S of memory traffic
// (two_shot: 5S; the ring: 4.5S with 2(n-1) hand-offs per round). One rank computes each
// element, so every rank gets the same bytes; half types reduce in one step in float32.
// In place (out == in) is safe: a round stages parts of its input before anything of that round
// is written, and rounds cover disjoint elements.
#include <cstring>
#include <vector>

#include "algo/algo.h"
#include "core/errors.h"

namespace plait {

namespace {
// The finished part is copied to staging in pieces this large right after reducing each, while
// the piece is still in L2 (1 MiB per core here). Not tuned: any size well inside L2 should do.
constexpr size_t kFinishPiece = size_t(64) << 10;
}  // namespace

void allreduce_staged_parts(Ctx& c) { allreduce_staged_parts_rounds(c, 0); }

void allreduce_staged_parts_rounds(Ctx& c, int64_t first_step) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const Slots slots(tp, 2);
  // Part q of every round sits at q * stride in a slot, whatever the round's length, so that a
  // shorter last round never writes where a peer may still read an earlier round's part.
  const int64_t stride = c.elems_in(slots.bytes / size_t(n));
  if (stride < 1)
    throw InvalidArgument("allreduce staged_parts: " + std::to_string(slots.bytes) +
                          "-byte staging slots hold no element per rank for " + std::to_string(n) +
                          " ranks; raise buffer_bytes");
  const int64_t chunk = stride * n;
  const int64_t rounds = (c.a.count + chunk - 1) / chunk;
  // Part q of round k: elements [off + b, off + e) of the vector, at q * stride in the slot;
  // every part has at most stride elements, and all of a full round's start on a 64-byte line.
  const auto part = [&](int64_t k, int q, int64_t* b, int64_t* e) {
    const int64_t len = std::min(chunk, c.a.count - (k - 1) * chunk);
    *b = part_begin(len, n, q);
    *e = part_begin(len, n, q + 1);
    return (k - 1) * chunk;
  };
  const auto at = [&](int p, int64_t k, int q) {
    return slots.at(p, first_step + k) + size_t(q) * size_t(stride) * c.esize;
  };
  const auto stage = [&](int64_t k) {
    tp.wait_ack_all(0, first_step + k - slots.count());  // peers done reading its staged parts
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      int64_t b, e;
      const int64_t off = part(k, q, &b, &e);
      std::memcpy(at(r, k, q), c.in_at(off + b), size_t(e - b) * c.esize);
    }
    tp.post(0, first_step + k);
  };
  std::vector<const void*> src(static_cast<size_t>(n));
  const int64_t piece = std::max<int64_t>(1, c.elems_in(kFinishPiece));
  if (rounds > 0) stage(1);
  for (int64_t k = 1; k <= rounds; ++k) {
    int64_t b, e;
    const int64_t off = part(k, r, &b, &e);
    tp.wait_post_all(0, first_step + k);
    tp.wait_ack_all(1, k - slots.count());  // peers done copying the slot's finished part
    for (int64_t lo = b; lo < e; lo += piece) {
      const int64_t len = std::min(piece, e - lo);
      for (int p = 0; p < n; ++p)
        src[size_t(p)] = p == r ? static_cast<const void*>(c.in_at(off + lo))
                                : at(p, k, r) + size_t(lo - b) * c.esize;
      c.reduce(c.out_at(off + lo), src.data(), n, len, true);
      std::memcpy(at(r, k, r) + size_t(lo - b) * c.esize, c.out_at(off + lo),
                  size_t(len) * c.esize);
    }
    tp.ack(0, first_step + k);
    tp.post(1, k);
    if (k < rounds) stage(k + 1);
    tp.wait_post_all(1, k);
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      int64_t pb, pe;
      part(k, p, &pb, &pe);
      std::memcpy(c.out_at(off + pb), at(p, k, p), size_t(pe - pb) * c.esize);
    }
    tp.ack(1, k);
  }
}

}  // namespace plait
