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
void allreduce_single_copy(Ctx&);
void reduce_scatter_single_copy(Ctx&);
void allgather_single_copy(Ctx&);
void broadcast_single_copy(Ctx&);
void reduce_single_copy(Ctx&);
void alltoall_single_copy(Ctx&);

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
      {Coll::allreduce, "single_copy", allreduce_single_copy, true},
      {Coll::reduce_scatter, "direct", reduce_scatter_direct},
      {Coll::reduce_scatter, "ring", reduce_scatter_ring},
      {Coll::reduce_scatter, "single_copy", reduce_scatter_single_copy, true},
      {Coll::allgather, "direct", allgather_direct},
      {Coll::allgather, "ring", allgather_ring},
      {Coll::allgather, "single_copy", allgather_single_copy, true},
      {Coll::broadcast, "direct", broadcast_direct},
      {Coll::broadcast, "single_copy", broadcast_single_copy, true},
      {Coll::reduce, "direct", reduce_direct},
      {Coll::reduce, "single_copy", reduce_single_copy, true},
      {Coll::alltoall, "direct", alltoall_direct},
      {Coll::alltoall, "single_copy", alltoall_single_copy, true},
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

// The choices below come from `plait-bench -a all` runs on the 2-core development VM (numbers and
// commands in bench/RESULTS.md). Two ranks, a core each: single copy (one kernel copy from the
// peer's buffer, and for allreduce the finished chunk pushed into the peer's output from a hot
// cache, with two synchronisations per call) beats every staged algorithm from 16 KiB for
// allreduce, from 8-16 KiB per rank for allgather and reduce_scatter; below that one_shot (or
// direct) wins, its single synchronisation dominating. Broadcast and reduce were once thought no
// better with single copy, but those runs timed `auto` under every label; measured per algorithm
// (2026-12-03, `plait-bench -n 2 -c broadcast,reduce,alltoall -a all -b 4K -e 128M`) single copy
// is 4-7x faster from 16 KiB (broadcast 1 MiB: 85 vs 455 us; reduce 1 MiB: 88 vs 432 us), except
// reduce from 64 MiB, where staged reduce ran 2x faster (5.9 vs 11.6 ms) in two runs. Alltoall
// stays staged: single copy was slower at every size but 256 KiB. When ranks outnumber cores,
// system calls and their context switches cost more than staging: one_shot up to 16 KiB, then
// two_shot, whose two synchronisations per chunk cost less than the ring's 2(n-1) hand-offs. Tree
// never won here.
int auto_select(Coll c, size_t bytes, int world, size_t staging_bytes, bool single_copy,
                bool oversubscribed) {
  const bool sc = single_copy && !oversubscribed;
  switch (c) {
    case Coll::reduce_scatter:
      return sc && bytes >= 16 * 1024 ? 2 : 0;  // single_copy : direct
    case Coll::allgather:
      return sc && bytes >= 8 * 1024 ? 2 : 0;  // single_copy : direct
    case Coll::broadcast:
      return sc && bytes >= 16 * 1024 ? 1 : 0;  // single_copy : direct
    case Coll::reduce:
      return sc && bytes >= 16 * 1024 && bytes < (size_t(64) << 20) ? 1
                                                                    : 0;  // single_copy : direct
    case Coll::allreduce:
      break;
    default:
      return 0;
  }
  if (sc && bytes >= 16 * 1024) return 4;  // single_copy
  const size_t one_shot_max = world <= 2 ? 64 * 1024 : 16 * 1024;
  if (bytes <= one_shot_max && bytes <= staging_bytes / 2) return 0;  // one_shot
  return world <= 2 ? 2 : 1;                                          // ring : two_shot
}

}  // namespace plait
