// The one ordered table of algorithms, host and GPU, and the "auto" choice between them.
#include <cstring>

#include "algo/algo.h"
#include "core/errors.h"

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
void allreduce_shared_or_staged(Ctx&);
void allreduce_staged_parts(Ctx&);
void allgather_shared_or_staged(Ctx&);

#if PLAIT_WITH_CUDA
void gpu_allreduce_nccl(GpuCtx&);
void gpu_reduce_scatter_nccl(GpuCtx&);
void gpu_allgather_nccl(GpuCtx&);
void gpu_broadcast_nccl(GpuCtx&);
void gpu_reduce_nccl(GpuCtx&);
void gpu_alltoall_nccl(GpuCtx&);
void gpu_send_nccl(GpuCtx&);
void gpu_recv_nccl(GpuCtx&);
void gpu_allreduce_ring(GpuCtx&);
void gpu_reduce_scatter_ring(GpuCtx&);
void gpu_allgather_ring(GpuCtx&);
void gpu_allreduce_tree(GpuCtx&);
void ipc_allreduce_one_shot(IpcCtx&);
void ipc_allreduce_two_shot(IpcCtx&);
void ipc_allreduce_ring(IpcCtx&);
void ipc_reduce_scatter_one_shot(IpcCtx&);
void ipc_allgather_one_shot(IpcCtx&);
void ipc_reduce_scatter_ring(IpcCtx&);
void ipc_allgather_ring(IpcCtx&);
#endif

namespace {
// Every rank has already arrived (the transport posts arrival before any algorithm runs), so a
// barrier is the wait for everyone's arrival.
void barrier_direct(Ctx& c) { c.tp.wait_post_all(0, 0); }
}  // namespace

namespace {
constexpr Caps kHost = kCapHostStaging;
constexpr Caps kSingleCopy = kCapHostStaging | kCapPeerRead;
constexpr Caps kIpc = kCapCudaIpc;
constexpr Caps kNccl = kCapNcclColl;    // NCCL's own collective
constexpr Caps kNcclP2p = kCapNcclP2p;  // plait's steps over NCCL send/recv
}  // namespace

const std::vector<Algorithm>& algorithm_table() {
  static const std::vector<Algorithm> table = {
      {Coll::allreduce, "one_shot", kHost, allreduce_one_shot},
      {Coll::allreduce, "two_shot", kHost, allreduce_two_shot},
      {Coll::allreduce, "ring", kHost, allreduce_ring},
      {Coll::allreduce, "tree", kHost, allreduce_tree},
      {Coll::allreduce, "single_copy", kSingleCopy, allreduce_single_copy},
      {Coll::allreduce, "shared_or_staged", kSingleCopy, allreduce_shared_or_staged},
      {Coll::allreduce, "staged_parts", kHost, allreduce_staged_parts},
      {Coll::reduce_scatter, "direct", kHost, reduce_scatter_direct},
      {Coll::reduce_scatter, "ring", kHost, reduce_scatter_ring},
      {Coll::reduce_scatter, "single_copy", kSingleCopy, reduce_scatter_single_copy},
      {Coll::allgather, "direct", kHost, allgather_direct},
      {Coll::allgather, "ring", kHost, allgather_ring},
      {Coll::allgather, "single_copy", kSingleCopy, allgather_single_copy},
      {Coll::allgather, "shared_or_staged", kSingleCopy, allgather_shared_or_staged},
      {Coll::broadcast, "direct", kHost, broadcast_direct},
      {Coll::broadcast, "single_copy", kSingleCopy, broadcast_single_copy},
      {Coll::reduce, "direct", kHost, reduce_direct},
      {Coll::reduce, "single_copy", kSingleCopy, reduce_single_copy},
      {Coll::alltoall, "direct", kHost, alltoall_direct},
      {Coll::alltoall, "single_copy", kSingleCopy, alltoall_single_copy},
      {Coll::barrier, "direct", kHost, barrier_direct},
#if PLAIT_WITH_CUDA
      {Coll::allreduce, "nccl", kNccl, gpu_allreduce_nccl},
      {Coll::allreduce, "ring", kNcclP2p, gpu_allreduce_ring},
      {Coll::allreduce, "tree", kNcclP2p, gpu_allreduce_tree},
      {Coll::reduce_scatter, "nccl", kNccl, gpu_reduce_scatter_nccl},
      {Coll::reduce_scatter, "ring", kNcclP2p, gpu_reduce_scatter_ring},
      {Coll::allgather, "nccl", kNccl, gpu_allgather_nccl},
      {Coll::allgather, "ring", kNcclP2p, gpu_allgather_ring},
      {Coll::broadcast, "nccl", kNccl, gpu_broadcast_nccl},
      {Coll::reduce, "nccl", kNccl, gpu_reduce_nccl},
      {Coll::alltoall, "nccl", kNcclP2p, gpu_alltoall_nccl},
      {Coll::send, "nccl", kNcclP2p, gpu_send_nccl},
      {Coll::recv, "nccl", kNcclP2p, gpu_recv_nccl},
      {Coll::allreduce, "one_shot", kIpc, ipc_allreduce_one_shot},
      {Coll::allreduce, "two_shot", kIpc, ipc_allreduce_two_shot},
      {Coll::allreduce, "ring", kIpc, ipc_allreduce_ring},
      {Coll::reduce_scatter, "one_shot", kIpc, ipc_reduce_scatter_one_shot},
      {Coll::reduce_scatter, "ring", kIpc, ipc_reduce_scatter_ring},
      {Coll::allgather, "one_shot", kIpc, ipc_allgather_one_shot},
      {Coll::allgather, "ring", kIpc, ipc_allgather_ring},
#endif
  };
  return table;
}

const std::vector<const Algorithm*>& algorithms_for(Coll c, Caps offered) {
  constexpr size_t kColls = size_t(Coll::kCount);
  static const auto per_caps = [] {  // [caps][coll], for every set of capabilities
    std::vector<std::vector<const Algorithm*>> v(size_t(kCapAll + 1) * kColls);
    for (Caps m = 0; m <= kCapAll; ++m)
      for (const Algorithm& a : algorithm_table())
        if ((a.needs & ~m) == 0) v[size_t(m) * kColls + size_t(a.coll)].push_back(&a);
    return v;
  }();
  static const std::vector<const Algorithm*> none;
  if (unsigned(c) >= unsigned(Coll::kCount)) return none;
  return per_caps[size_t(offered & kCapAll) * kColls + size_t(c)];
}

int algorithm_index(Coll c, Caps offered, const std::string& name) {
  const auto& algos = algorithms_for(c, offered);
  for (size_t i = 0; i < algos.size(); ++i)
    if (name == algos[i]->name) return int(i);
  return -1;
}

int algorithm_row(const std::string& name) {
  const auto& table = algorithm_table();
  for (size_t i = 0; i < table.size(); ++i)
    if (name == table[i].name) return int(i);
  return -1;
}

AlgoOverride::AlgoOverride(const std::string& t, Caps offered, bool strict, const char* env_name)
    : text(t), forced(size_t(Coll::kCount)) {
  size_t at = 0;
  while (at < text.size()) {
    size_t comma = text.find(',', at);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(at, comma - at);
    at = comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string name = eq == std::string::npos ? item : item.substr(eq + 1);
    bool used = false;
    for (int c = 0; c < int(Coll::kCount); ++c) {
      if (eq != std::string::npos && item.substr(0, eq) != coll_name(Coll(c))) continue;
      // A bare name applies where the collective has it; "coll=name" applies to that one.
      const bool has = algorithm_index(Coll(c), offered, name) >= 0;
      if (has || (eq != std::string::npos && !strict)) forced[size_t(c)] = name, used = true;
    }
    if (!used && strict)
      throw InvalidArgument(std::string(env_name) + ": '" + item +
                            "' names no algorithm (see plait.algorithms(collective))");
  }
}

int select_algorithm(Coll c, const std::string& asked, const AlgoOverride& ov, Caps offered,
                     const AutoInputs& in, int rank, const std::string& unavailable,
                     std::string* why) {
  const bool asked_auto = asked == "auto" || asked.empty();
  const std::string& forced = asked_auto ? ov.forced[size_t(c)] : asked;
  const char* want = forced.empty() ? auto_algorithm(c, in) : forced.c_str();
  const auto& algos = algorithms_for(c, offered);
  for (size_t i = 0; i < algos.size(); ++i) {
    if (std::strcmp(want, algos[i]->name) != 0) continue;
    if ((algos[i]->needs & ~in.caps) && in.world > 1) {
      *why = "rank " + std::to_string(rank) + ": " + coll_name(c) + " algorithm '" + want +
             "' is not available on this communicator: " + unavailable;
      return -1;
    }
    return int(i);
  }
  std::string names;
  for (const Algorithm* a : algos) names += std::string(names.empty() ? "" : ", ") + a->name;
  *why = "rank " + std::to_string(rank) + ": " + coll_name(c) + " has no algorithm '" + want +
         "' (" + (names.empty() ? "none here" : "choose auto, " + names) + ")";
  return -1;
}

// The choices below come from `plait-bench -a all` runs on the 2-core development VMs (numbers and
// commands in bench/RESULTS.md). Until 2026-12-04 they were placed on an Intel Xeon VM (2 MiB L2
// per core): two ranks, a core each, single copy (one kernel copy from the peer's buffer, and for
// allreduce the finished chunk pushed into the peer's output from a hot cache, with two
// synchronisations per call) beat every staged algorithm from 16 KiB for allreduce, from 8-16 KiB
// per rank for allgather and reduce_scatter; below that one_shot (or direct) won, its single
// synchronisation dominating. On the AMD EPYC VM (1 MiB L2, 32 MiB L3) the staged algorithms, whose
// copies stay in the cache, beat the kernel copy of private pages over most of the middle range
// (there "shared_or_staged" runs, which keeps single copy for plait shared buffers, whose mapped
// pages peers read with plain loads, and stages the others): 2-rank allreduce
// ring 143-155 us at 2 MiB against single copy 205-233 (DeepSpeed's shared-memory allreduce 153),
// allgather direct 49 us against 82 at 2 MiB; single copy keeps 64-128 KiB (allreduce) and 32-128
// KiB per rank (allgather), and from 8 MiB (allreduce) and 4 MiB per rank (allgather), where
// numpy's arrays sit on huge pages and the kernel copy runs at memcpy speed. From 256 KiB the
// staged allreduce is "staged_parts" (2026-12-05: it stages only the parts peers reduce; 10-20%
// faster than the ring at 1-2 MiB, even at 4 MiB). It also beat single copy at 8-16 MiB in one
// harness on a quieter VM, but under load (plait-bench, ranks pinned, load 5-10) its two
// synchronisations per 1 MiB round cost 2-3x against single copy's two per call, so single copy
// keeps 8 MiB and up (RESULTS.md 2026-12-05). Below 16 KiB the
// allreduce ring beats one_shot from 2 KiB (8 KiB: 2.0-2.1 vs 2.3 us). Those crossovers hold
// for two ranks; larger worlds keep single copy throughout (no measurement here: a 2-core VM has no
// un-oversubscribed world above 2). Broadcast and reduce were once thought no better with single
// copy, but those runs timed `auto` under every label; measured per algorithm (2026-12-03,
// `plait-bench -n 2 -c broadcast,reduce,alltoall -a all -b 4K -e 128M`) single copy is 4-7x faster
// from 16 KiB (broadcast 1 MiB: 85 vs 455 us; reduce 1 MiB: 88 vs 432 us), except reduce from 64
// MiB, where staged reduce ran 2x faster (5.9 vs 11.6 ms) in two runs. Alltoall stays staged:
// single copy was slower at every size but 256 KiB. When ranks outnumber cores, system calls and
// their context switches cost more than staging: one_shot up to 16 KiB, then two_shot, whose two
// synchronisations per chunk cost less than the ring's 2(n-1) hand-offs. Tree never won here.
//
// Over the GPU transports no measurement has been made yet to place thresholds: auto is NCCL's
// own collective over NCCL and one_shot over CUDA IPC (each transport's first row).
const char* auto_algorithm(Coll c, const AutoInputs& in) {
  if (in.caps & kCapNcclColl) return "nccl";
  if (in.caps & kCapCudaIpc) return "one_shot";
  const bool sc = (in.caps & kCapPeerRead) && !in.oversubscribed;
  const size_t bytes = in.bytes;
  constexpr size_t K = 1024, M = K * K;
  switch (c) {
    case Coll::reduce_scatter:
      return sc && bytes >= 16 * K ? "single_copy" : "direct";
    case Coll::allgather:
      if (sc && in.world == 2 && bytes >= 8 * K)  // bytes: one rank's block
        return (bytes >= 32 * K && bytes < 256 * K) || bytes >= 4 * M ? "single_copy"
                                                                      : "shared_or_staged";
      return sc && bytes >= 8 * K ? "single_copy" : "direct";
    case Coll::broadcast:
      return sc && bytes >= 16 * K ? "single_copy" : "direct";
    case Coll::reduce:
      return sc && bytes >= 16 * K && bytes < 64 * M ? "single_copy" : "direct";
    case Coll::allreduce:
      break;
    default:
      return "direct";
  }
  if (sc && in.world == 2 && bytes >= 2 * K) {
    if (bytes < 16 * K) return "ring";
    return (bytes >= 64 * K && bytes < 256 * K) || bytes >= 8 * M ? "single_copy"
                                                                  : "shared_or_staged";
  }
  if (sc && bytes >= 16 * K) return "single_copy";
  const size_t one_shot_max = in.world <= 2 ? 64 * K : 16 * K;
  if (bytes <= one_shot_max && bytes <= in.staging_bytes / 2) return "one_shot";
  return in.world <= 2 ? "ring" : "two_shot";
}

}  // namespace plait
