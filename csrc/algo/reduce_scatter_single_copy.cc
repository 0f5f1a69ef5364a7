// reduce_scatter "single_copy": rank r reduces block r itself, reading every peer's block r
// straight from the peer's input (Transport::read_peer) into L2-sized scratch, then one n-way
// reduce in rank order into its output. Each rank reads (n-1)/n of S from peers once and never
// stages anything. In place (output = this rank's block of the input) is safe: peers read only
// the other blocks of this rank's input, and this rank writes only its own block.
#include "algo/algo.h"

namespace plait {

void reduce_scatter_single_copy(Ctx& c) {
  Transport& tp = c.tp;
  tp.expose(c.a.in, c.a.out);
  tp.post(0, 1);
  reduce_range_from_peers(c, c.out_at(0), int64_t(c.rank) * c.a.count, c.a.count);
  tp.ack(0, 1);           // done reading every peer
  tp.wait_ack_all(0, 1);  // and every peer is done reading this rank
}

}  // namespace plait
