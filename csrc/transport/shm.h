// Shared-memory transport: one POSIX segment per communicator, mapped by every rank of it.
//
// Layout (all offsets computed locally from the rendezvous parameters, never read from the
// segment): a header page; one control block per rank (post/ack step counters, the call
// fingerprints, liveness); the ranks' staging areas; one two-slot channel per ordered rank pair
// for send/recv; each rank's flight recorder ring (core/flight.h).
#pragma once
#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/call.h"
#include "core/errors.h"
#include "core/flight.h"
#include "core/wait.h"
#include "transport/shared_mem.h"
#include "transport/transport.h"

namespace plait {

// What every rank must agree on for one call; compared pairwise through the segment.
struct Fingerprint {
  uint64_t seq = 0;
  int64_t count = 0;
  int32_t root = 0;
  uint8_t coll = 0, dtype = 0, op = 0, algo = 0;
};
static_assert(sizeof(Fingerprint) == 24, "fingerprint must stay on the post line");

// The fields two fingerprints differ in, as "call number, count" ("" when none do); algo is
// compared only when with_algo (the multi-host check's frames carry no algorithm).
std::string fingerprint_diff(const Fingerprint& a, const Fingerprint& b, bool with_algo);

// What ranks must agree on for one GPU call (its work is enqueued on a stream, not run through
// this segment): each rank publishes its calls in its own ring of kGpuPrints slots, slot
// seq % kGpuPrints, and compares with what peers published for the same call number
// (core/call_check.h).
struct GpuPrint {
  std::atomic<uint64_t> seq;  // 0 while the slot is being written, else the call it holds
  int64_t count;
  int32_t root;
  uint32_t algo;  // a hash of the algorithm that will run
  uint8_t coll, dtype, op, pad[5];
};
static_assert(sizeof(GpuPrint) == 32, "two GPU prints to a cache line");
constexpr uint32_t kGpuPrints = 64;

enum RankState : uint32_t { kStarting = 0, kAlive = 1, kExited = 2, kDead = 3 };

struct alignas(64) Line {
  std::atomic<uint64_t> v;
};

// Channel 0 of a call: the step counter, the call's fingerprint and a small inline payload on
// one cache line, one line per call parity (calls s and s+1 may overlap across ranks). A reader
// that sees the post has the fingerprint and, for tiny messages, the data in the same transfer.
constexpr size_t kInlineBytes = 32;
struct alignas(64) PostLine {
  std::atomic<uint64_t> v;
  Fingerprint fp;
  unsigned char data[kInlineBytes];
};
static_assert(sizeof(PostLine) == 64, "a post line is one cache line");

struct RankCtl {
  PostLine post0[2];  // at [seq & 1]
  alignas(64) std::atomic<uint64_t> post1;
  alignas(64) std::atomic<uint64_t> ack[2];
  alignas(64) std::atomic<uint64_t> done;  // last call this rank completed
  std::atomic<uint64_t> cur_seq;           // call this rank is in (for timeout reports)
  std::atomic<uint32_t> state;
  int32_t pid;
  std::atomic<uint32_t> can_read;     // 0 probing, 1 this rank can read every peer, 2 not
  uint64_t probe_addr;                // an address in this process holding a known word
  alignas(64) uint64_t addr[2][2];    // {in, out} exposed by call seq, at [seq & 1]
  RegionRef reg[2][2];                // the plait shared buffers holding them, if any
  alignas(64) pthread_mutex_t alive;  // robust; held by the rank's progress thread
};

struct SegHeader {
  uint64_t magic;
  uint32_t version, size;
  uint64_t token[2];
  uint64_t staging_bytes, pair_slot_bytes, total_bytes;
  std::atomic<uint32_t> attached;
  uint32_t flight_slots;
  alignas(64) std::atomic<uint32_t> abort_kind;  // ErrorKind, or kWriting while the text is written
  int32_t abort_rank;
  char abort_msg[1536];
};

struct PairSlotHeader {
  uint64_t msg;  // per-pair message number
  int64_t tag;
  uint64_t nbytes;  // whole message
  uint32_t dtype;
};

class Segment {
 public:
  struct Params {
    std::string name;
    int size = 1;
    size_t staging_bytes = 0;    // per rank
    size_t pair_slot_bytes = 0;  // per send/recv slot
    uint64_t token[2] = {0, 0};
    uint32_t flight_slots = 0;  // flight records per rank (0: no recorder)
  };
  static std::unique_ptr<Segment> create(const Params& p);
  static std::unique_ptr<Segment> open(const Params& p);
  static size_t bytes_needed(int size, size_t staging, size_t pair_slot, uint32_t flight_slots = 0);
  ~Segment();

  // Every rank has mapped it: removes the name. Idempotent.
  void unlink();
  const Params& params() const { return p_; }
  SegHeader* header() const { return reinterpret_cast<SegHeader*>(base_); }
  RankCtl* ctl(int r) const { return reinterpret_cast<RankCtl*>(base_ + ctl_off_) + r; }
  char* staging(int r) const { return base_ + staging_off_ + size_t(r) * p_.staging_bytes; }
  Line* pair_posted(int src, int dst) const { return pair_lines(0) + (src * p_.size + dst); }
  Line* pair_taken(int src, int dst) const { return pair_lines(1) + (src * p_.size + dst); }
  char* pair_slot(int src, int dst, uint64_t slot) const;  // header followed by data
  uint32_t flight_slots() const { return p_.flight_slots; }
  FlightHead* flight_head(int r) const {
    return reinterpret_cast<FlightHead*>(base_ + flight_off_ +
                                         size_t(r) * (size_t(p_.flight_slots) + 1) * 64);
  }
  FlightRecord* flight_ring(int r) const {
    return reinterpret_cast<FlightRecord*>(flight_head(r) + 1);
  }
  GpuPrint* gpu_prints(int r) const {
    return reinterpret_cast<GpuPrint*>(base_ + gpu_off_) + size_t(r) * kGpuPrints;
  }

 private:
  Segment(const Params& p, char* base, size_t bytes);
  Line* pair_lines(int which) const {
    return reinterpret_cast<Line*>(base_ + pair_ctl_off_) + size_t(which) * p_.size * p_.size;
  }
  Params p_;
  char* base_;
  size_t bytes_;
  size_t ctl_off_, pair_ctl_off_, staging_off_, pair_data_off_, flight_off_, gpu_off_;
  bool unlinked_ = false;
};

// The Transport over a Segment for one rank, plus the per-call protocol: epochs, fingerprints,
// deadlines, liveness and the communicator-wide abort.
class ShmTransport final : public Transport {
 public:
  // The name of the algorithm a fingerprint's index stands for, for mismatch reports (the
  // algorithm table is the communicator's; a transport does not know it).
  using AlgoNames = const char* (*)(Coll c, unsigned index);
  ShmTransport(Segment& seg, int rank, const WaitPolicy& policy, AlgoNames algo_names);

  char* staging(int r) override { return seg_.staging(r) + half_; }
  size_t staging_bytes() const override { return seg_.params().staging_bytes / 2; }
  void post(int ch, int64_t step) override;
  void wait_post(int peer, int ch, int64_t step) override;
  void ack(int ch, int64_t step) override;
  void wait_ack(int peer, int ch, int64_t step) override;
  unsigned char* inline_slot(int r) override { return seg_.ctl(r)->post0[seq_ & 1].data; }
  size_t inline_bytes() const override { return kInlineBytes; }

  // Collective calls: begin() waits until the previous-but-one call is finished everywhere,
  // publishes the fingerprint and arrives; end() verifies the left neighbour and marks done.
  // now: the caller's clock reading (seconds), 0 to read it here.
  void begin(const CallArgs& a, const char* algo_name, uint64_t seq, uint8_t algo_idx,
             double now = 0);
  void end();
  // Runs `ready` until it returns true, with backoff, deadline and liveness of `peers` (-1: none).
  template <class Ready>
  void wait_until(Ready&& ready, int peer);
  // wait_until for a wait that found its condition false: tells the flight recorder whom it waits
  // for, and (when a trace is written) adds the time to waited_ns().
  template <class Ready>
  void slow_wait(Ready&& ready, int peer, FlightWait what, uint64_t step);
  void set_flight(FlightRecorder* f, bool timing) { flight_ = f, timing_ = timing; }
  // Called while a wait finds nothing (every 128 spins, every yield or nap), on the waiting
  // thread: the communicator moves the send/recv it set aside for the call (core/p2p.cc).
  void set_idle_hook(std::function<void()> f) { idle_hook_ = std::move(f); }
  uint64_t take_waited_ns() { return std::exchange(waited_ns_, 0); }

  // Communicator-wide abort: records (kind, text) once; every rank's waits then throw it.
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg);
  void throw_if_aborted();
  bool aborted() const;
  std::string describe_call() const;
  // Returns a message if peer p is known to be gone; *died: it died (not an orderly exit).
  bool peer_gone(int p, std::string* why, bool* died = nullptr);

  // Send/recv use the same deadline and liveness machinery outside of collective epochs.
  void set_deadline(double deadline, const CallArgs* a, const char* algo_name);
  // Throws on an abort, on the deadline, or when `peer` (if >= 0) is gone (checked every 2 ms).
  void check(double t, int peer);
  // check() without raising: false with what went wrong (an abort still raises at once).
  bool healthy(double t, int peer, ErrorKind* kind, std::string* msg);
  Segment& segment() { return seg_; }
  uint64_t seq() const { return seq_; }

  // Single copy (process_vm_readv). probe_peers() runs once every rank is alive: it tries to
  // read each peer and publishes the result; agree_on_reads() waits for every rank's result and
  // enables single copy only if all of them can read all peers. `allow` false (PLAIT_SINGLE_COPY=0)
  // publishes "no".
  void probe_peers(bool allow);
  void agree_on_reads(double deadline);
  bool can_read_peers() const override { return can_read_; }
  const std::string& read_unavailable() const { return no_read_why_; }
  void expose(const void* in, void* out) override;
  const char* peer_in(int p) override;
  const char* peer_out(int p) override;
  void read_peer(int p, void* dst, const char* src, size_t bytes) override;
  void write_peer(int p, char* dst, const void* src, size_t bytes, bool stream = false) override;
  char* peer_local(int p, const char* remote, size_t bytes) override;
  bool peer_maps(int p, const char* remote, size_t bytes) override {
    return map_peer(p, remote, bytes) != nullptr;
  }
  uint64_t mapped_bytes() const override { return mapped_bytes_.load(std::memory_order_relaxed); }

 private:
  void verify(int peer);
  void meet(int peer);
  void arrive();
  std::string deadline_message(int peer);
  std::atomic<uint64_t>& post_ctr(int r, int ch) {
    return ch == 0 ? seg_.ctl(r)->post0[seq_ & 1].v : seg_.ctl(r)->post1;
  }

  Segment& seg_;
  const WaitPolicy& policy_;
  AlgoNames algo_names_;
  size_t half_ = 0;
  uint64_t seq_ = 0, epoch_ = 0;
  bool arrived_ = true;
  const CallArgs* call_ = nullptr;
  const char* algo_name_ = "";
  double deadline_ = 0;
  std::vector<double> last_live_check_;
  std::vector<uint8_t> verified_;
  bool can_read_ = false;
  std::string no_read_why_ = "not probed";
  uint64_t probe_word_ = 0;
  std::vector<int32_t> peer_pid_;
  PeerMappings maps_;
  std::atomic<uint64_t> mapped_bytes_{0};  // read by other threads (comm.mapped_bytes)
  FlightRecorder* flight_ = nullptr;
  std::function<void()> idle_hook_;
  bool timing_ = false;
  uint64_t waited_ns_ = 0;
  void copy_peer(bool write, int p, char* local, char* remote, size_t bytes);
  char* map_peer(int p, const char* remote, size_t bytes);
};

// Each call's steps live in the low 24 bits of the counters, its sequence number above them.
constexpr int kStepBits = 24;
constexpr uint64_t kMaxSteps = (uint64_t(1) << kStepBits) - 1;

template <class Ready>
void ShmTransport::wait_until(Ready&& ready, int peer) {
  if (ready()) return;
  Backoff b(policy_);
  do {
    b.idle([&](double t) {
      // The peer may have done what we wait for and left (or the deadline may have passed) since
      // our last look: look once more before calling it lost or late.
      if (idle_hook_) idle_hook_();
      ErrorKind kind;
      std::string msg;
      if (!healthy(t, peer, &kind, &msg) && !ready()) fail(kind, msg);
    });
  } while (!ready());
}

template <class Ready>
void ShmTransport::slow_wait(Ready&& ready, int peer, FlightWait what, uint64_t step) {
  if (flight_) flight_->waiting(peer, what, step);
  const uint64_t t0 = timing_ ? mono_ns() : 0;
  wait_until(ready, peer);
  if (timing_) waited_ns_ += mono_ns() - t0;
  if (flight_) flight_->waited();
}

}  // namespace plait
