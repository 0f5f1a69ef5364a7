// A fake NCCL for host tests: the NcclApi plait loads (cuda/nccl_loader.h), over ranks that are
// threads of one process. Communicators of one unique id form a world; point-to-point and
// collectives move host memory through per-pair FIFOs when their stream reaches them (the fake
// CUDA runtime's executors), so a call returns before its data moved, as with NCCL. Groups follow
// NCCL's thread-local depth: operations queued inside one are launched together by the outermost
// ncclGroupEnd; ncclCommAbort inside an open group is only queued (NCCL's src/group.cc), which the
// fake counts as a lost abort. A non-blocking communicator (config.blocking = 0) returns
// ncclInProgress from init and group ends, and counts a launch on cudaStreamPerThread (NCCL would
// launch it from its own thread, on that thread's stream).
#pragma once
#include <atomic>
#include <functional>

#include "cuda/nccl_loader.h"

namespace fake {

const plait::NcclApi& nccl_api();
plait::nccl::UniqueId nccl_world(int n);  // a new world of n ranks

struct NcclStats {
  std::atomic<int> inits{0}, aborts{0}, lost_aborts{0}, finalizes{0}, destroys{0}, ptds_launches{0};
  std::atomic<int> unfinalized_destroys{0};
  std::atomic<int> groups{0}, sends{0}, recvs{0};
};
NcclStats& nccl_stats();
void nccl_reset_stats();
int nccl_group_depth();  // this thread's
// The `nth` (1-based) ncclSend of `rank` from now on returns ncclRemoteError, as NCCL does once a
// peer failed (ncclCommEnsureReady). 0: none.
void nccl_fail_send(int rank, int nth);
// The next ncclCommGetAsyncError on this thread runs `hook` first (one shot): a test holds a
// thread there, inside whatever lock its caller holds.
void nccl_on_async_error(std::function<void()> hook);
// Makes every rank's pending receives of this world give up with ncclRemoteError (a peer died).
void nccl_break_world(const plait::nccl::UniqueId& id);

}  // namespace fake
