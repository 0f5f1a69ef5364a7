// broadcast "single_copy": every non-root reads the root's buffer straight into its output
// (Transport::read_peer). The root only publishes its address and waits until all have read.
#include <cstring>

#include "algo/algo.h"

namespace plait {

void broadcast_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  const int root = c.a.root;
  const size_t bytes = size_t(c.a.count) * c.esize;
  if (c.rank == root) {
    tp.expose(c.a.in, c.a.out);
    tp.post(0, 1);
    if (c.a.out && c.a.out != c.a.in) std::memcpy(c.a.out, c.a.in, bytes);
    tp.wait_ack_all(0, 1);
    return;
  }
  tp.wait_post(root, 0, 1);
  tp.read_peer(root, c.a.out, tp.peer_in(root), bytes);
  tp.ack(0, 1);
}

}  // namespace plait
