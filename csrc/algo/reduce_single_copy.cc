// reduce "single_copy": the root reads each peer's input straight from the peer's memory
// (Transport::read_peer) into L2-sized scratch and reduces the n inputs in rank order into its
// output; the other ranks only publish their addresses and wait until the root has read them.
// Nothing is staged: the root reads (n-1)*S from peers once.
#include <vector>

#include "algo/algo.h"

namespace plait {

void reduce_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int n = c.size, r = c.rank, root = c.a.root;
  if (r != root) {
    tp.expose(c.a.in, nullptr);
    tp.post(0, 1);
    tp.wait_ack(root, 0, 1);  // the root has read all of this rank's input
    return;
  }
  const int64_t m = c.a.count;
  const int64_t chunk = std::max<int64_t>(1, c.elems_in(kSingleCopyScratch / size_t(n - 1)));
  char* tmp = scratch(size_t(n - 1) * size_t(chunk) * c.esize);
  std::vector<const void*> src(static_cast<size_t>(n));
  for (int p = 0; p < n; ++p)
    if (p != r) tp.wait_post(p, 0, 1);
  for (int64_t lo = 0; lo < m; lo += chunk) {
    const int64_t len = std::min(chunk, m - lo);
    reduce_from_peers(c, c.out_at(lo), c.in_at(lo), size_t(lo) * c.esize, len, tmp,
                      size_t(chunk) * c.esize, src);
  }
  tp.ack(0, 1);
}

}  // namespace plait
