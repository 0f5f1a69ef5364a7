// Flight recorder: each rank keeps its last N calls in the communicator's shared segment, so the
// ranks that survive a kill -9 or a frozen peer can say what every rank was doing.
//
// One ring per rank: a head line (records begun, what the rank waits on now) and N one-line
// records. The owner writes; any rank reads. A record is published seqlock-style (version odd
// while it is written), and a reader trusts nothing it reads from the segment: a torn, stale or
// scribbled record is reported as such (flight.cc). Recording a call costs a coarse clock read
// (its start is the reading the call's deadline takes anyway) and a dozen stores to lines only
// this rank writes: ~9 ns (bench/RESULTS.md, flight recorder).
#pragma once
#include <time.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/call.h"

namespace plait {

class Segment;

// enqueued: a GPU call handed to its stream (the ring records when it was issued, not when the
// device ran it).
enum class FlightState : uint8_t { empty = 0, running, ok, failed, enqueued, kCount };
// What a rank waits for: a peer's arrival in the call, a post (data) or an ack at a step, or a
// send/recv chunk.
enum class FlightWait : uint8_t { arrival = 0, post, ack, p2p, kCount };
enum class FlightTransport : uint8_t { shm = 0, nccl, ipc, kCount };

struct alignas(64) FlightRecord {
  std::atomic<uint32_t> ver;  // odd while the owner writes
  uint8_t coll, dtype, op, algo;
  uint8_t transport, state, exact, pad;  // exact: end_ns from the precise clock, not the coarse
  int32_t root;                          // root of broadcast/reduce, peer of send/recv, else -1
  uint64_t index;  // position in the rank's history: tells a stale or scribbled slot apart
  uint64_t call;   // the collective's call number (#seq), or the send/recv message number
  int64_t count;
  int64_t tag;
  uint64_t start_ns, end_ns;  // CLOCK_MONOTONIC, the same clock in every process of a host
};
static_assert(sizeof(FlightRecord) == 64, "a flight record is one cache line");

struct alignas(64) FlightHead {
  std::atomic<uint64_t> next;     // records begun
  std::atomic<uint64_t> waiting;  // 0, or kWaitingBit | what << 56 | peer << 40 | step
};

constexpr uint64_t kWaitingBit = uint64_t(1) << 63;
constexpr uint32_t kMaxFlightSlots = 1 << 16;
// A GPU record's algo byte (transport nccl/ipc): the algorithm's row in algorithm_table()
// (algo/algo.h, algorithm_row), or one of these.
constexpr uint8_t kFlightAlgoAuto = 0xFF;     // "auto": the communicator did not resolve it
constexpr uint8_t kFlightAlgoUnknown = 0xFE;  // a name no row of this build has

inline uint64_t mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// The same clock at the kernel tick's resolution (a few ms) for a third of the cost (measured
// 13 ns vs 44 ns here): a call's end time in the ring, where no trace needs it exact.
inline uint64_t coarse_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return uint64_t(ts.tv_sec) * 1000000000u + uint64_t(ts.tv_nsec);
}

// The writing side, owned by one rank's communicator. Inactive (every method a no-op) when the
// segment has no rings or this rank set PLAIT_FLIGHT=0.
class FlightRecorder {
 public:
  void attach(FlightHead* head, FlightRecord* ring, uint32_t slots) {
    head_ = slots ? head : nullptr;
    ring_ = ring;
    slots_ = slots;
  }
  bool on() const { return head_ != nullptr; }

  // Records the start of a call; returns its index for end().
  uint64_t begin(const CallArgs& a, uint64_t call, uint8_t algo, uint64_t now) {
    if (!head_) return 0;
    const uint64_t i = next_++;
    FlightRecord& r = ring_[i % slots_];
    const uint32_t v = r.ver.load(std::memory_order_relaxed);
    r.ver.store(v | 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    r.coll = uint8_t(a.coll), r.dtype = uint8_t(a.dtype), r.op = uint8_t(a.op), r.algo = algo;
    r.transport = uint8_t(FlightTransport::shm), r.state = uint8_t(FlightState::running),
    r.exact = 0;
    r.root = a.coll == Coll::send || a.coll == Coll::recv          ? a.peer
             : a.coll == Coll::broadcast || a.coll == Coll::reduce ? a.root
                                                                   : -1;
    r.index = i, r.call = call, r.count = a.count, r.tag = a.tag;
    r.start_ns = now, r.end_ns = 0;
    r.ver.store((v | 1) + 1, std::memory_order_release);
    head_->next.store(next_, std::memory_order_release);
    return i;
  }
  // A GPU call as it is issued: transport nccl or ipc, algo a row (kFlightAlgo* above).
  void enqueued(const CallArgs& a, uint64_t call, uint8_t algo, FlightTransport t, uint64_t now) {
    if (!head_) return;
    const uint64_t i = begin(a, call, algo, now);
    FlightRecord& r = ring_[i % slots_];
    const uint32_t v = r.ver.load(std::memory_order_relaxed);
    r.ver.store(v | 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    r.transport = uint8_t(t), r.state = uint8_t(FlightState::enqueued), r.end_ns = now;
    r.ver.store((v | 1) + 1, std::memory_order_release);
  }
  void end(uint64_t i, bool ok, uint64_t now, bool exact) {
    if (!head_) return;
    FlightRecord& r = ring_[i % slots_];
    if (r.index != i) return;  // overwritten by calls that began since (more than N in flight)
    const uint32_t v = r.ver.load(std::memory_order_relaxed);
    r.ver.store(v | 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    r.state = uint8_t(ok ? FlightState::ok : FlightState::failed);
    r.exact = exact;
    r.end_ns = now;
    r.ver.store((v | 1) + 1, std::memory_order_release);
  }
  // The wait helpers say whom they wait for on their slow path only (one store each way).
  void waiting(int peer, FlightWait what, uint64_t step) {
    if (!head_) return;
    head_->waiting.store(kWaitingBit | uint64_t(what) << 56 |
                             (uint64_t(uint32_t(peer)) & 0xffff) << 40 |
                             (step & ((uint64_t(1) << 40) - 1)),
                         std::memory_order_relaxed);
  }
  void waited() {
    if (head_) head_->waiting.store(0, std::memory_order_relaxed);
  }

 private:
  FlightHead* head_ = nullptr;
  FlightRecord* ring_ = nullptr;
  uint32_t slots_ = 0;
  uint64_t next_ = 0;
};

// The report every rank can build from the segment: JSON (plait.dump, e.flight) and a few lines
// of text for an exception's message. `me` is the reading rank; `label` names the communicator.
struct FlightReport {
  std::string json, summary;
};
// states[r]: what the reader knows of rank r's liveness ("alive", "dead", ...).
FlightReport flight_report(const Segment& seg, int me, const std::string& label,
                           const std::string& error, const std::vector<std::string>& states);
// Where the report starts in an exception's message (tests and tools cut the message there).
constexpr const char* kFlightMarker = "\nflight recorder";

// Test hook: overwrites rank r's ring with bytes drawn from `seed` (checks that readers cope).
void flight_scribble(const Segment& seg, int r, uint64_t seed);

}  // namespace plait
