// The multi-host communicator: plait's shared-memory Communicator inside each host, an engine
// (hier/engine.h: gloo, MPI) between hosts. One call is one closure task on the local
// communicator's progress thread (Communicator::submit), so async calls need no thread of their
// own and nothing waits in Python.
//
//   local  the ranks of this host (local rank = order by global rank)
//   inter  uniform layout (every host has L ranks): the shard group of local rank i, i.e. local
//          rank i of every host, H members in host order. Else the leaders (local rank 0 of each
//          host; null on the other ranks).
//   world  every rank, for alltoall and send/recv between hosts. send/recv are stepped tasks
//          (hier_p2p.cc) that progress together with the send/recv around them, so exchanges
//          cannot wait on each other; a recv from any rank asks this host's channels and the
//          world engine's probe which sender has a message ready, then receives that one.
//
// Hosts are ordered by their lowest global rank; a host's ranks need not be contiguous.
//
// The cross-host check: every call's first exchange on an engine group is an allgather of one
// frame per member: a header (magic, the core's Fingerprint from transport/shm.h, payload bytes)
// that every member compares with every other's, and, when the call's engine payload fits the
// frame's room, the payload itself. A frame's size never depends on the call being made, so
// members that make different calls still exchange them, and a mismatch is a MismatchError naming
// both calls and hosts, never wrong data or a hang. A small call costs one engine message, check
// included; a larger one a header-only frame (overlapped with its first local step where it can
// be), then its data.
//
// The room follows the calls (kMinRoom..kRoom bytes): it grows at once to the next power of two
// above a call's payload that would fit kRoom, and after kShrinkAfter calls in a row that would
// all have fitted half of it, shrinks to the largest of their needs (engine messages cost more with
// size: a 2 KiB frame took ~100 us more than a 128-byte one in a gloo allgather here). Every rank
// updates it the same way from its own collective calls (send/recv, which only some ranks make,
// leave it alone), so the members of every engine group agree on it whenever their earlier calls
// matched, which the check ensures.
//
// Allreduce, uniform layout (Horovod's and NCCL's pattern), N elements, f = N / L, r = N % L:
//   small  the frame carries the input; local rank i reduces its shard group's inputs in host
//          order (the same bytes on every host), then the host's ranks allreduce that in place
//   1. local reduce_scatter of the first L*f elements (local rank i owns [i*f, (i+1)*f)); the r
//      left over are reduced to the last local rank, which owns them too
//   2. inter allreduce of what rank i owns across the H hosts (shard group i)
//   3. local allgather of the owned blocks in place in the output; broadcast of the r left over
//   Past the frame's room this goes piece by piece (kPieceLog2; every piece but the last a
//   multiple of L elements): piece k's engine allreduce is started (engine.h allreduce_start)
//   and runs while this rank gathers piece k-1 and scatters piece k+1. Integer results are the
//   same bits as in one piece; the check frame is waited for before the first piece's payload.
// Avg sums, then divides once by the world size. Leaders layout: local reduce to the leader,
// leaders' allreduce, local broadcast. Element types or ops an engine lacks (engine->supports)
// are allgathered and reduced on plait's kernels in host order, so every rank gets the same bytes.
//
// Errors: the first error of a call aborts the local communicator (every rank of this host), sets
// the engines' job-wide flag (every other host) and is raised here; later calls raise
// "communicator aborted after an earlier error".
#pragma once
#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/comm.h"
#include "core/communicator.h"
#include "hier/engine.h"
#include "transport/shm.h"

namespace plait {

// Which global ranks share a host, as python/plait/_hosts.Layout derives it from every rank's
// host identity (here: a number per rank; equal numbers = one host).
struct HierLayout {
  HierLayout(const std::vector<int64_t>& host_ids, int rank);
  std::vector<std::vector<int>> hosts;  // global ranks of host h, ascending
  std::vector<int> host_of, local_of;   // per global rank
  int h = 0, i = 0;                     // this rank's host and local rank
  bool uniform = false;                 // every host has as many ranks
  bool in_order = false;                // uniform and rank == i * H + h (no reordering needed)
  std::vector<int> perm;                // uniform: perm[i * H + h] = hosts[h][i]
  int nhosts() const { return int(hosts.size()); }
  std::string describe_host(int host) const;  // "host 1: local ranks 0..1 are global ranks [2, 3]"
};

// The frame every call's first engine message is (see above).
constexpr size_t kFrame = 2048, kFrameHead = 64, kRoom = kFrame - kFrameHead, kMinRoom = 64;
constexpr int kShrinkAfter = 16;
constexpr uint64_t kFrameMagic = 0x706C616974;  // "plait"

// The uniform layout's large allreduce goes in pieces of 2^kPieceLog2 bytes, so that one piece's
// engine step overlaps the next one's local reduce_scatter and the last one's local allgather
// (hier_colls.cc). Measured with bench/hier_torch.py (bench/RESULTS-hier.md, 2026-12-05).
constexpr int kPieceLog2 = 22;

// One engine group as the communicator drives it: owns the plait_engine (releases it once),
// turns its error returns into typed errors naming the group, and keeps the group's frames.
class EngineGroup {
 public:
  EngineGroup(plait_engine* e, std::string label, std::vector<int> ranks);
  ~EngineGroup();
  EngineGroup(const EngineGroup&) = delete;
  EngineGroup& operator=(const EngineGroup&) = delete;

  int rank() const { return e_->rank; }
  int size() const { return e_->size; }
  const char* engine() const { return e_->name; }
  const std::vector<int>& ranks() const { return ranks_; }  // global rank of each member
  // "the inter-host gloo group shard0 (global ranks [0, 2])"
  std::string what() const;

  // In place; falls back to allgather + plait's kernels for (dtype, op) the engine lacks.
  void allreduce(void* buf, int64_t count, DType dt, RedOp op, double deadline);
  // True when allreduce_start returns before the op ends (the engine has it, for this dtype/op).
  bool can_start(DType dt, RedOp op) const;
  // allreduce in two halves: a request for wait(), or null when it ran to its end here (nothing
  // to do, or an engine without allreduce_start or without this dtype/op).
  void* allreduce_start(void* buf, int64_t count, DType dt, RedOp op, double deadline);
  void allgather(const void* in, void* out, size_t bytes, double deadline);
  void* allgather_start(const void* in, void* out, size_t bytes);
  void wait(void* req, double deadline);  // either start's request; null: nothing
  void broadcast(void* buf, size_t bytes, int root, double deadline);
  void alltoall(const void* in, void* out, size_t block_bytes, double deadline);
  void send(const void* buf, size_t bytes, int peer, int tag, double deadline);
  void recv(void* buf, size_t bytes, int peer, int tag, double deadline);
  // send/recv in two halves (engine.h's p2p_start/p2p_test; only where can_start_p2p()): a
  // request for p2p_test, or null when nothing travels; p2p_test is true once it finished (the
  // request is then freed) and throws its error.
  bool can_start_p2p() const {
    return PLAIT_ENGINE_HAS(e_, p2p_start) && PLAIT_ENGINE_HAS(e_, p2p_test);
  }
  void* p2p_start(bool send, void* buf, size_t bytes, int peer, int tag, double deadline);
  bool p2p_test(void* req);
  // engine.h's probe (only where can_probe()): the member whose message of tag is ready, or -1;
  // *bytes its size (PLAIT_ENGINE_UNKNOWN: the engine tells it only on receipt).
  bool can_probe() const { return PLAIT_ENGINE_HAS(e_, probe); }
  int probe(int tag, size_t* bytes);
  void fail(ErrorKind kind, const std::string& msg);

  // This rank's frame: the payload area (up to kRoom bytes) to fill before exchange/post.
  uint8_t* room() { return send_.data() + kFrameHead; }
  std::vector<uint8_t>& sent() { return send_; }
  std::vector<uint8_t>& got() { return recv_; }

 private:
  void check(uint32_t rc, const char* op, const char* err);
  plait_engine* e_;
  std::string label_;
  std::vector<int> ranks_;
  std::vector<uint8_t> send_, recv_;  // kFrame, size * kFrame (frames use a prefix of each slot)
};

class HierComm final : public Comm {
 public:
  // inter may be null (leaders layout, not a leader); world may not. Takes ownership of both
  // engines (releases them when finalized).
  HierComm(std::shared_ptr<Communicator> local, int rank, int size,
           const std::vector<int64_t>& host_ids, plait_engine* inter, plait_engine* world,
           double timeout_s, const std::string& label);
  ~HierComm() override;
  HierComm(const HierComm&) = delete;
  HierComm& operator=(const HierComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool closed() const override { return closed_; }
  std::shared_ptr<Task> call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root,
                             int peer, int64_t tag, const std::string& algo,
                             std::optional<double> timeout_s, bool async,
                             Task::Done on_done = nullptr) override;
  bool run_here(const std::shared_ptr<Task>& t) override { return local_->run_here(t); }
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg) override;
  void finalize() override;
  void set_label(const std::string& label) override;
  std::string label() const override;

  const HierLayout& layout() const { return lay_; }
  std::string engine() const { return world_->engine(); }
  // The GPU queue of all ranks (one NCCL communicator across the hosts, made by plait._gpu at the
  // first GPU call): device buffers are enqueued there on their stream, as on a flat communicator.
  // Attaching twice is refused.
  void attach_device(std::shared_ptr<DeviceQueue> q);
  const std::shared_ptr<Communicator>& local() const { return local_; }
  size_t frame_room() const { return room_; }  // between calls only (the progress thread sets it)

 private:
  void run_call(CallArgs& a, const Fingerprint& fp);
  [[noreturn]] void on_error(const CallArgs& a, const PlaitError& e);
  void abort_everywhere(ErrorKind kind, const std::string& msg);
  std::string head(const CallArgs& a) const;
  [[noreturn]] void raise_aborted() const;

  // The frame exchange (hier_frames.cc): post starts the allgather of this rank's frame (header +
  // the first nbytes of its room; check_only: the header alone, not sent at all when the check
  // is off: PLAIT_HIER_CHECK=0) and finish waits and compares
  // every header, returning the members' payloads (frame() apart). No group: nothing happens.
  struct Posted {
    EngineGroup* g = nullptr;
    void* req = nullptr;
    const Fingerprint* fp = nullptr;
  };
  Posted post(EngineGroup* g, const Fingerprint& fp, size_t nbytes, bool check_only,
              double deadline);
  const uint8_t* finish(Posted& p, double deadline);
  void head(EngineGroup& g, const Fingerprint& fp, size_t nbytes);  // this rank's frame header
  const uint8_t* compare(EngineGroup& g, const Fingerprint& fp);    // every member's header
  // post + finish; check_only: a header-only frame (skipped under PLAIT_HIER_CHECK=0).
  const uint8_t* exchange(EngineGroup* g, const Fingerprint& fp, size_t nbytes, double deadline,
                          bool check_only = false);
  [[noreturn]] void mismatch(EngineGroup& g, const Fingerprint& mine, const uint8_t* theirs, int j);
  // out = the op over the members' payload rows (each frame() apart, at byte offset off), in
  // group order; avg divides by the world size in the same pass.
  void combine(void* out, const uint8_t* rows, int n, size_t off, int64_t count, DType dt,
               RedOp op);

  // Local steps (inline on this thread: we are inside the closure task); errors name the host.
  void local(Coll c, const void* in, size_t in_bytes, void* out, size_t out_bytes, DType dt,
             RedOp op, int root, double deadline, bool has_out = true);
  void local_barrier(double deadline);

  // The collectives (hier_colls.cc); byte-moving ones take bytes.
  void allreduce(const CallArgs& a, const Fingerprint& fp, const void* x, void* out,
                 double deadline);
  // The uniform layout's allreduce past the frame's room, in pieces (see hier_colls.cc).
  void allreduce_pieces(const CallArgs& a, const Fingerprint& fp, const void* x, uint8_t* out,
                        double deadline);
  void reduce_scatter(const CallArgs& a, const Fingerprint& fp, double deadline);
  void allgather(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t n, double deadline);
  void broadcast(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t k, int root,
                 double deadline);
  void inter_broadcast(const Fingerprint& fp, uint8_t* out, size_t k, int hr, double deadline);
  void alltoall(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t blk, double deadline);
  // send/recv (hier_p2p.cc): a stepped task of the local communicator (Communicator::
  // submit_step), so that it progresses with the send/recv around it: a same-host peer's turns
  // into the local communicator's own send/recv; another host's goes through the world engine's
  // p2p_start/p2p_test; a recv from any rank polls both sides until one has a message.
  struct P2PState;
  std::shared_ptr<Task> p2p_call(const CallArgs& a, bool async, Task::Done on_done);
  int p2p_step(CallArgs& x, P2PState& st);
  int p2p_remote(CallArgs& x, P2PState& st);
  int p2p_any(CallArgs& x, P2PState& st);
  // A failed send/recv's message as its waiters see it (the host and rank named), recorded as
  // the communicator's first error and sent to every rank of every host, as on_error does.
  std::string p2p_error(const CallArgs& a, P2PState& st, ErrorKind kind, const std::string& msg);
  std::string record_error(ErrorKind kind, const std::string& msg);
  // Records msg as the communicator's first error and sends it to every rank of every host;
  // false (nothing sent) when an earlier error was recorded.
  bool first_failure(ErrorKind kind, const std::string& msg);
  void barrier(const Fingerprint& fp, double deadline);
  void divide(void* buf, int64_t count, DType dt);

  // The frame's room (see above): whether a payload of `bytes` rides in the next frame; wants()
  // records what a call would carry (every rank, leader or not), adapt() applies it after the call.
  bool fits(size_t bytes) const { return bytes <= room_; }
  // The frame's size, every member's alike; adapt() changes it only after a call's last exchange.
  size_t frame() const { return kFrameHead + room_; }
  void wants(size_t bytes) { want_ = std::max(want_, bytes); }
  void adapt();

  std::shared_ptr<Communicator> local_;
  int rank_, size_;
  HierLayout lay_;
  std::unique_ptr<EngineGroup> inter_, world_;
  double timeout_s_;
  std::mutex dev_mu_;
  std::shared_ptr<DeviceQueue> dev_;  // GPU calls' queue; null until the first GPU call
  // Calls issued, in issue order: the fingerprints' call number. Atomic: threads may issue calls
  // (their order across threads is the caller's to keep the same on every rank, as on one host).
  std::atomic<uint64_t> seq_{0};
  bool closed_ = false;
  bool check_ = true;  // header-only frames (PLAIT_HIER_CHECK=0 skips them)
  // The frame's room and its history (on the progress thread only: calls run one at a time).
  size_t room_ = kRoom, want_ = 0, shrink_to_ = kMinRoom;
  int shrink_run_ = 0;
  bool adaptive_ = true;  // PLAIT_HIER_FRAME_ADAPT=0: the room stays kRoom (for A/B measurements)
  // log2 of the large allreduce's piece bytes (PLAIT_HIER_PIECE_BYTES, rounded down to a power
  // of two in [4 KiB, 1 GiB]; 0 there: one piece)
  int piece_log2_ = kPieceLog2;
  mutable std::mutex mu_;  // first_error_, label_
  std::string first_error_;
  std::string label_;
};

}  // namespace plait
