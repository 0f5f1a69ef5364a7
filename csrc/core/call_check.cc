// The call check for work that does not run through the segment (GPU calls over NCCL or CUDA IPC).
//
// Host calls compare fingerprints as part of the call's own arrival. A GPU call's arrival is on
// the device, so before this check every GPU call paid a host allreduce of its fingerprint: a
// rendezvous of all ranks' host threads per call (~15-50 us here) that also kept ranks in
// lock-step. Now each rank publishes the call in its own ring of the segment and compares it with
// whatever its peers already published for the same call number, without waiting for anyone:
//
//   publish: slot[seq % kGpuPrints] <- fields, then slot.seq <- seq    (seq_cst)
//   compare: for each peer, its slot for seq, if it holds seq          (seqlock read)
//
// Of two ranks, whichever publishes second sees the other's entry (a store then a load, both
// sequentially consistent, as in Dekker's algorithm), so every disagreement is found by at least
// one rank, which aborts the communicator on every rank with MismatchError; the others raise it
// at their next call, and their GPU watchdogs abort the work already enqueued. A rank more than
// kGpuPrints calls ahead of a peer has overwritten the slot the peer would compare with: those
// calls go unchecked (NCCL's own deadline still ends a mismatched call).
#include <cstring>
#include <sstream>

#include "core/communicator.h"

namespace plait {

namespace {
struct Fields {
  int64_t count;
  int32_t root;
  uint32_t algo;
  uint8_t coll, dtype, op;
};

bool read_slot(const GpuPrint& s, uint64_t seq, Fields* f) {
  if (s.seq.load(std::memory_order_acquire) != seq) return false;
  *f = Fields{s.count, s.root, s.algo, s.coll, s.dtype, s.op};
  std::atomic_thread_fence(std::memory_order_acquire);
  return s.seq.load(std::memory_order_relaxed) == seq;  // not rewritten while we read it
}

std::string describe(const Fields& f, const std::string& algo) {
  std::ostringstream o;
  o << coll_name(Coll(f.coll)) << " count=" << f.count
    << " dtype=" << (f.dtype < uint8_t(DType::kCount) ? dtype_name(DType(f.dtype)) : "?")
    << " op=" << (f.op < uint8_t(RedOp::kCount) ? op_name(RedOp(f.op)) : "?") << " root=" << f.root
    << " algorithm=" << algo;
  return o.str();
}
}  // namespace

uint32_t algo_hash(const std::string& name) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 16777619u;
  return h;
}

void Communicator::check_gpu_call(const CallArgs& call, const char* algo_name, bool ipc,
                                  int device) {
  const Coll c = call.coll;
  const DType dtype = call.dtype;
  const RedOp op = call.op;
  const int64_t count = call.count;
  const int32_t root = call.root;
  const std::string algo = algo_name;
  tp_.throw_if_aborted();  // a mismatch a peer found in an earlier call surfaces here
  const uint64_t seq = gpu_seq_.fetch_add(1, std::memory_order_relaxed) + 1;
  const Fields mine{count, root, algo_hash(algo), uint8_t(c), uint8_t(dtype), uint8_t(op)};
  GpuPrint& slot = seg_->gpu_prints(rank_)[seq % kGpuPrints];
  slot.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  slot.count = mine.count;
  slot.root = mine.root;
  slot.algo = mine.algo;
  slot.coll = mine.coll;
  slot.dtype = mine.dtype;
  slot.op = mine.op;
  slot.seq.store(seq, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (int p = 0; p < size_; ++p) {
    Fields theirs;
    if (p == rank_ || !read_slot(seg_->gpu_prints(p)[seq % kGpuPrints], seq, &theirs)) continue;
    std::string diff;
    auto field = [&](bool same, const char* name) {
      if (!same) diff += (diff.empty() ? "" : ", ") + std::string(name);
    };
    field(theirs.coll == mine.coll, "collective");
    field(theirs.count == mine.count, "count");
    field(theirs.dtype == mine.dtype, "dtype");
    field(theirs.op == mine.op, "op");
    field(theirs.root == mine.root, "root");
    field(theirs.algo == mine.algo, "algorithm");
    if (diff.empty()) continue;
    const std::string head = "rank " + std::to_string(rank_) + ": " + coll_name(c) + " (" +
                             dtype_name(dtype) + " x " + std::to_string(count) + " on GPU " +
                             std::to_string(device) + ")";
    fail(ErrorKind::mismatch,
         head + ": mismatched GPU calls: ranks " + std::to_string(rank_) + " and " +
             std::to_string(p) + " disagree on " + diff + " at GPU call #" + std::to_string(seq) +
             " (rank " + std::to_string(rank_) + ": " + describe(mine, algo) + "; rank " +
             std::to_string(p) + ": " +
             describe(theirs, theirs.algo == mine.algo ? algo : "another") + ")");
  }
  // The flight recorder keeps the call too, as issued (its device-side end is not known here).
  CallArgs a;
  a.coll = c, a.dtype = dtype, a.op = op, a.count = count, a.peer = -1, a.tag = 0;
  a.root = c == Coll::broadcast || c == Coll::reduce ? root : -1;
  const int row = algo == "auto" ? -1 : algorithm_row(algo);
  const uint8_t idx = algo == "auto"                         ? kFlightAlgoAuto
                      : row < 0 || row >= kFlightAlgoUnknown ? kFlightAlgoUnknown
                                                             : uint8_t(row);
  flight_.enqueued(a, seq, idx, ipc ? FlightTransport::ipc : FlightTransport::nccl, mono_ns());
}

}  // namespace plait