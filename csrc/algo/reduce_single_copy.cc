// reduce "single_copy": the root reads each peer's input straight from the peer's memory
// (Transport::read_peer) into L2-sized scratch and reduces the n inputs in rank order into its
// output; the other ranks only publish their addresses and wait until the root has read them.
// Nothing is staged: the root reads (n-1)*S from peers once.
#include "algo/algo.h"

namespace plait {

void reduce_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int root = c.a.root;
  if (c.rank != root) {
    tp.expose(c.a.in, nullptr);
    tp.post(0, 1);
    tp.wait_ack(root, 0, 1);  // the root has read all of this rank's input
    return;
  }
  reduce_range_from_peers(c, c.out_at(0), 0, c.a.count);
  tp.ack(0, 1);
}

}  // namespace plait
