// The watchdog of a GPU communicator: one thread that follows the calls in flight (an event
// recorded before and after each) and, while any is pending, polls what can keep it from ever
// finishing: the communicator's own errors (NCCL's async error, an IPC kernel that gave up), the
// CPU communicator's abort, peers that died, and each call's deadline (counted from when its
// first kernel started, so user work queued ahead on the stream does not eat it). On the first
// of these it calls abort() once: the communicator aborts its GPU work (ncclCommAbort, the IPC
// abort word) and records the error for every rank. Without it a synchronous call whose peer died
// would hang the next torch.cuda.synchronize() for ever, since nobody polls such a call.
// Plain C++ (events are opaque handles the communicator creates and queries), so CPU tests drive
// it with fake events (plait._C._WatchdogProbe).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"

namespace plait {

// Hooks into the CPU communicator of the same ranks.
struct GpuPeers {
  std::function<void()> throw_if_aborted;                   // the abort some rank recorded
  std::function<void(ErrorKind, const std::string&)> fail;  // record one (may throw; ignored)
  std::function<std::string()> dead_peer;                   // "rank p (pid) died", or ""

  // Why GPU work in flight cannot finish, as the CPU communicator knows it ("" while all is well).
  std::string why_stuck(ErrorKind* kind) const {
    if (throw_if_aborted) {
      try {
        throw_if_aborted();
      } catch (const PlaitError& e) {
        *kind = e.kind();
        return std::string("another rank aborted the communicator: ") + e.what();
      }
    }
    const std::string dead = dead_peer ? dead_peer() : std::string();
    if (!dead.empty()) *kind = ErrorKind::peer_lost;
    return dead;
  }
  void tell(ErrorKind kind, const std::string& msg) const {
    try {
      if (fail) fail(kind, msg);
    } catch (const std::exception&) {
    }
  }

  // Records the error for the CPU communicator's ranks, then raises it here (the CPU
  // communicator reports an abort by throwing too: ours is the error to raise).
  [[noreturn]] void tell_and_throw(ErrorKind kind, const std::string& msg) const {
    tell(kind, msg);
    throw_error(kind, msg);
  }
};

class Watchdog {
 public:
  using Event = void*;
  struct Hooks {
    std::function<Event()> create;  // a new event (never null)
    std::function<void(Event)> destroy;
    // 1 done, 0 not yet, -1 failed: then *why names the error (cudaGetErrorName).
    std::function<int(Event, std::string* why)> query;
    // Run once on the watchdog's thread before it queries anything (CUDA: the thread's capture
    // mode, so that its queries never touch another thread's CUDA-graph capture). May be empty.
    std::function<void()> on_thread_start;
    // Why pending work cannot finish ("" while all is well); sets *kind. Polled while work is in
    // flight and once after it drained (an IPC error word is read after the kernel ran).
    std::function<std::string(ErrorKind*)> poll;
    // Aborts the communicator and records the error for every rank; must not throw.
    std::function<void(ErrorKind, const std::string&)> abort;
  };

  Watchdog(Hooks hooks, double poll_interval_s);
  ~Watchdog();  // stops the thread; pending calls are forgotten, not waited for
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  Event acquire();  // an event to record (recycled once its call is done)
  // Follows one call: `start` recorded before its first kernel, `end` after its last.
  void track(Event start, Event end, double timeout_s, const std::string& what);
  size_t in_flight();
  bool fired();  // abort() was called
  // Waits until nothing is in flight or abort() fired; false when max_s passed first.
  bool drain(double max_s);

 private:
  struct Call {
    Event start, end;
    double timeout_s, started = -1;
    std::string what;
  };
  void loop();
  void fire(ErrorKind kind, const std::string& msg, std::unique_lock<std::mutex>& lock);

  Hooks h_;
  double interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Call> calls_;
  std::vector<Event> free_, all_;
  bool stop_ = false, fired_ = false, polled_after_drain_ = true;
  std::thread thread_;
};

double watchdog_now_s();

}  // namespace plait
