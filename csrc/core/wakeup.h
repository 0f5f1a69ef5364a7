// How a communicator's progress thread sleeps and is woken: at once, or only after a grace period.
//
// A small async collective is usually waited on within microseconds of being issued (torch's
// dist.*(async_op=True).wait(), Handle.wait), and the waiter then runs it on its own thread
// (Communicator::run_here). Waking the progress thread for it anyway costs more than the call: a
// futex wake-up of an idle vCPU takes ~27 us here (shared/notes/machine.md), and the woken thread
// preempts the caller or races it for the task (0.6 involuntary switches of the caller per call
// at 2 ranks, counted from /proc/self/task/*/status).
//
// So such a call is queued without a wake-up and a periodic timer (period grace/2) is started:
// the thread takes a call nobody ran within the grace period, so every async call still starts
// within `grace` of being issued even if its caller never waits (a peer may depend on it). A
// waiter, a sync call behind async ones, a send/recv or finalize kicks the thread at once. The
// timer is armed once per burst of async calls (arming costs ~6 us here, a VM exit) and stops
// after a few idle periods. A communicator whose callers leave calls beyond the grace (they
// overlap them with other work) starts its next async calls at once instead (Communicator).
//
// The grace trades the timer's wake-ups against how late an unwaited call may start. At 4 ranks
// on 2 cores, torch's 8-byte async+wait / sync (median of paired batches, plait.torch.overhead)
// measured 2.8-2.9 with a wake-up per call, 1.24-1.78 with 1 ms (2,000 timer wake-ups a second
// per rank), 1.18-1.71 with 2 ms (4 of 5 runs under 1.5), 1.15-1.31 with 5 ms (5 of 5).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace plait {

// The default grace (PLAIT_ASYNC_GRACE_US overrides it; 0 wakes the thread for every call).
constexpr uint64_t kAsyncGraceNs = 5000000;
// Only calls of at most this many bytes (count x item size) are deferred (PLAIT_ASYNC_DEFER_BYTES
// overrides it). A 64 KiB allreduce
// takes ~10 us at 2 ranks, the order of the wake-up it saves; a larger call gains little and
// loses overlap with its caller's work: FSDP2 steps (MiB all-gathers, prefetched, waited a layer
// later) took ~7% longer with every async call deferred.
constexpr size_t kDeferMaxBytes = 64 << 10;

class Wakeup {
 public:
  explicit Wakeup(uint64_t grace_ns);  // grace 0: no timer (nothing is ever deferred)
  ~Wakeup();
  Wakeup(const Wakeup&) = delete;
  Wakeup& operator=(const Wakeup&) = delete;

  uint64_t grace_ns() const { return grace_ns_; }
  // Has the thread take every queued call, waking it now. Any thread, no lock needed; callers
  // holding the queue lock pass whether the thread sleeps (no wake-up needed if not).
  void kick(bool asleep = true);
  bool urgent() const { return urgent_.load(std::memory_order_acquire); }
  void clear_urgent() { urgent_.store(false, std::memory_order_release); }
  // The thread must come back within grace: starts the periodic timer if it is off. Callers
  // hold the communicator's queue lock (it guards the timer's state).
  void tick_on();
  // A period passed with nothing queued (queue lock held): the timer stops after a few.
  void idle_tick();
  // Blocks until kick() or a timer period (queue lock not held); true if the timer fired.
  bool sleep();

 private:
  uint64_t grace_ns_;
  int event_fd_ = -1;
  int timer_fd_ = -1;
  std::atomic<bool> urgent_{false};
  bool ticking_ = false;
  int idle_ticks_ = 0;
};

}  // namespace plait
