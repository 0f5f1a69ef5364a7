// The ordered table of algorithms, and the "auto" choice between them.
#include "algo/algo.h"

namespace plait {

void allreduce_one_shot(Ctx&);
void allreduce_two_shot(Ctx&);
void allreduce_ring(Ctx&);
void allreduce_tree(Ctx&);
void reduce_scatter_direct(Ctx&);
void reduce_scatter_ring(Ctx&);
void allgather_direct(Ctx&);
void allgather_ring(Ctx&);
void broadcast_direct(Ctx&);
void reduce_direct(Ctx&);
void alltoall_direct(Ctx&);

namespace {
// Every rank has already arrived (the transport posts arrival before any algorithm runs), so a
// barrier is the wait for everyone's arrival.
void barrier_direct(Ctx& c) { c.tp.wait_post_all(0, 0); }
}  // namespace

const char* coll_name(Coll c) {
  static const char* names[] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
                                "alltoall",  "barrier",        "send",      "recv"};
  return unsigned(c) < unsigned(Coll::kCount) ? names[unsigned(c)] : "?";
}

const std::vector<Algorithm>& algorithm_table() {
  static const std::vector<Algorithm> table = {
      {Coll::allreduce, "one_shot", allreduce_one_shot},
      {Coll::allreduce, "two_shot", allreduce_two_shot},
      {Coll::allreduce, "ring", allreduce_ring},
      {Coll::allreduce, "tree", allreduce_tree},
      {Coll::reduce_scatter, "direct", reduce_scatter_direct},
      {Coll::reduce_scatter, "ring", reduce_scatter_ring},
      {Coll::allgather, "direct", allgather_direct},
      {Coll::allgather, "ring", allgather_ring},
      {Coll::broadcast, "direct", broadcast_direct},
      {Coll::reduce, "direct", reduce_direct},
      {Coll::alltoall, "direct", alltoall_direct},
      {Coll::barrier, "direct", barrier_direct},
  };
  return table;
}

const std::vector<const Algorithm*>& algorithms_for(Coll c) {
  static const auto per_coll = [] {
    std::vector<std::vector<const Algorithm*>> v(size_t(Coll::kCount));
    for (const Algorithm& a : algorithm_table()) v[size_t(a.coll)].push_back(&a);
    return v;
  }();
  static const std::vector<const Algorithm*> none;
  return unsigned(c) < unsigned(Coll::kCount) ? per_coll[size_t(c)] : none;
}

// Thresholds from plait-bench sweeps on the 2-core development VM (bench/RESULTS.md): one_shot
// wins while its n-fold read stays in cache and one synchronisation dominates; above that the
// two-shot's smaller traffic wins. Ring and tree never beat them on one host but stay available.
int auto_select(Coll c, size_t bytes, int world, size_t staging_bytes) {
  if (c != Coll::allreduce) return 0;
  const size_t one_shot_max = world <= 2 ? 64 * 1024 : 16 * 1024;
  return bytes <= one_shot_max && bytes <= staging_bytes / 2 ? 0 : 1;
}

}  // namespace plait
