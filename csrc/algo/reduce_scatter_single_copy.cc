// reduce_scatter "single_copy": rank r reduces block r itself, reading every peer's block r
// straight from the peer's input (Transport::read_peer) into L2-sized scratch, then one n-way
// reduce in rank order into its output. Each rank reads (n-1)/n of S from peers once and never
// stages anything. In place (output = this rank's block of the input) is safe: peers read only
// the other blocks of this rank's input, and this rank writes only its own block.
#include <vector>

#include "algo/algo.h"

namespace plait {

void reduce_scatter_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank;
  const int64_t m = c.a.count, base = int64_t(r) * m;
  tp.expose(c.a.in, c.a.out);
  tp.post(0, 1);
  const int64_t chunk = std::max<int64_t>(1, c.elems_in(kSingleCopyScratch / size_t(n - 1)));
  char* tmp = scratch(size_t(n - 1) * size_t(chunk) * c.esize);
  std::vector<const void*> src(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) tp.wait_post(p, 0, 1);
  for (int64_t lo = 0; lo < m; lo += chunk) {
    const int64_t len = std::min(chunk, m - lo);
    reduce_from_peers(c, c.out_at(lo), c.in_at(base + lo), size_t(base + lo) * c.esize, len, tmp,
                      size_t(chunk) * c.esize, src);
  }
  tp.ack(0, 1);
  tp.wait_ack_all(0, 1);
}

}  // namespace plait
