// How plait waits: spin first, then yield, then sleep, checking a deadline and the peers' health.
// Measured here (../shared/notes/machine.md): a cross-core spin round trip is ~50 ns, a futex wake
// ~55 us, a yield hand-off between two processes on one core ~2 us. So a waiter spins for a few
// microseconds (never when ranks outnumber cores: the peer it waits for may need this core),
// then yields, and only after ~2 ms of yielding sleeps in growing naps of up to 200 us, so that
// 8 ranks on 2 cores neither livelock nor burn the core a late peer needs.
#pragma once
#include <sched.h>
#include <time.h>

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#define PLAIT_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PLAIT_PAUSE() asm volatile("yield")
#else
#define PLAIT_PAUSE() ((void)0)
#endif

namespace plait {

inline double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Told once per wait, on the waiting thread, when the wait stops spinning. The Python bindings
// release the GIL there: a small call that finishes within its spin budget then never pays for
// releasing and re-taking it (~35 ns of a ~0.5 us call), while a long wait still lets other
// Python threads run. Set per thread for the duration of one call (LongWaitScope).
class LongWaitHook {
 public:
  virtual void on_long_wait() = 0;

 protected:
  ~LongWaitHook() = default;
};

inline LongWaitHook*& long_wait_hook() {
  thread_local LongWaitHook* hook = nullptr;
  return hook;
}

inline void notify_long_wait() {
  if (LongWaitHook* h = long_wait_hook()) h->on_long_wait();
}

class LongWaitScope {
 public:
  explicit LongWaitScope(LongWaitHook* h) : prev_(long_wait_hook()) { long_wait_hook() = h; }
  ~LongWaitScope() { long_wait_hook() = prev_; }
  LongWaitScope(const LongWaitScope&) = delete;
  LongWaitScope& operator=(const LongWaitScope&) = delete;

 private:
  LongWaitHook* prev_;
};

struct WaitPolicy {
  uint32_t spin_iters = 512;  // ~25 us of pause loops; set to a few when ranks outnumber cores
  double yield_s = 2e-3;      // then yield this long before napping
};

// One wait in progress. idle() is called each time the condition was found false. check(t) runs
// every 128 spins and on every yield or nap; it must be cheap (the caller throttles its own
// expensive parts) and throws to end the wait on an abort, a deadline or a dead peer.
class Backoff {
 public:
  explicit Backoff(const WaitPolicy& p) : p_(p) {}
  void reset() { n_ = 0, start_ = 0, nap_ns_ = 0; }

  template <class Check>
  void idle(Check&& check) {
    if (++n_ <= p_.spin_iters) {
      PLAIT_PAUSE();
      if ((n_ & 127) == 0) check(now_s());
      return;
    }
    double t = now_s();
    if (start_ == 0) {
      start_ = t;
      notify_long_wait();
    }
    check(t);
    if (t - start_ < p_.yield_s) {
      sched_yield();
    } else {
      nap_ns_ = nap_ns_ ? (nap_ns_ * 2 > 200000 ? 200000 : nap_ns_ * 2) : 10000;
      timespec ts{0, long(nap_ns_)};
      nanosleep(&ts, nullptr);
    }
  }

 private:
  const WaitPolicy& p_;
  uint32_t n_ = 0;
  double start_ = 0;
  uint64_t nap_ns_ = 0;
};

}  // namespace plait
