#include <algorithm>

#include "algo/gpu_algo.h"

namespace plait {

// Two-shot allreduce: after the first exchange each rank reduces only its part (1/n) of the
// window, in rank order, into its output and into its own staging; a second exchange publishes
// those parts and each rank copies the others' into its output. Two synchronisations; each
// rank reads 2 (n - 1) / n of the vector from peers instead of one-shot's (n - 1). Parts begin on
// 16-byte boundaries (windows do: the staging is a multiple of 256 bytes), so every rank's
// reduction runs vectorised whatever n is.
void ipc_allreduce_two_shot(IpcCtx& c) {
  const int n = c.size;
  for (const Span& w :
       chunk_plan(c.a.count, std::max<int64_t>(1, int64_t(c.tp.staging_bytes() / c.esize)))) {
    const uint64_t first = c.begin();
    c.copy(c.tp.staging(c.rank), c.in_at(w.offset), w.count);
    c.publish(first);
    const int64_t align = std::max<int64_t>(1, 16 / int64_t(c.esize));
    const auto part = [&](int q) {
      const int64_t lo = aligned_part_begin(w.count, n, q, align);
      return Span{lo, aligned_part_begin(w.count, n, q + 1, align) - lo};
    };
    const Span mine = part(c.rank);
    std::vector<const char*> srcs;
    for (int p = 0; p < n; ++p) srcs.push_back(c.tp.staging(p) + c.bytes(mine.offset));
    c.reduce_all(c.out_at(w.offset + mine.offset), srcs, mine.count);
    // Only this rank reads part r of its own staging, so the reduced part may replace it now.
    c.copy(c.tp.staging(c.rank) + c.bytes(mine.offset), c.out_at(w.offset + mine.offset),
           mine.count);
    const uint64_t second = ++c.epoch;
    c.publish(second);
    for (int q = 0; q < n; ++q) {
      if (q == c.rank) continue;
      const Span theirs = part(q);
      c.copy(c.out_at(w.offset + theirs.offset), c.tp.staging(q) + c.bytes(theirs.offset),
             theirs.count);
    }
    c.finish(second);  // begin() of the next window waits for it: it covers both exchanges
  }
}

}  // namespace plait
