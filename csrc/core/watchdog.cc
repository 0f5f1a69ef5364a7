#include "core/watchdog.h"

#include <time.h>

#include <chrono>
#include <cstdio>

namespace plait {

double watchdog_now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

Watchdog::Watchdog(Hooks hooks, double poll_interval_s)
    : h_(std::move(hooks)), interval_(poll_interval_s) {
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (Event e : all_) h_.destroy(e);
}

Watchdog::Event Watchdog::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!free_.empty()) {
    Event e = free_.back();
    free_.pop_back();
    return e;
  }
  Event e = h_.create();
  all_.push_back(e);
  return e;
}

void Watchdog::track(Event start, Event end, double timeout_s, const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fired_) {  // the communicator is dead: nothing more to watch
      free_.push_back(start);
      free_.push_back(end);
      return;
    }
    calls_.push_back({start, end, timeout_s, -1, what});
    polled_after_drain_ = false;
  }
  cv_.notify_all();
}

size_t Watchdog::in_flight() {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

bool Watchdog::fired() {
  std::lock_guard<std::mutex> lock(mu_);
  return fired_;
}

bool Watchdog::drain(double max_s) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(max_s),
                      [&] { return fired_ || (calls_.empty() && polled_after_drain_); });
}

void Watchdog::fire(ErrorKind kind, const std::string& msg, std::unique_lock<std::mutex>& lock) {
  fired_ = true;
  for (const Call& c : calls_) {
    free_.push_back(c.start);
    free_.push_back(c.end);
  }
  calls_.clear();
  lock.unlock();  // abort() may block on the communicator's call lock, or take long (NCCL)
  try {
    h_.abort(kind, msg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "plait: GPU watchdog: aborting failed: %s\n", e.what());
  }
  lock.lock();
  cv_.notify_all();
}

void Watchdog::loop() {
  if (h_.on_thread_start) h_.on_thread_start();
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!fired_ && (!calls_.empty() || !polled_after_drain_)); });
    if (stop_) return;
    // Calls finish in issue order (each waits for the previous one's event), so the front is
    // the only one that can be running.
    while (!calls_.empty()) {
      Call& c = calls_.front();
      std::string err;
      const int st = h_.query(c.end, &err);
      if (st == 0) break;
      if (st < 0 && !fired_) {
        fire(ErrorKind::generic,
             c.what + ": the GPU reported an error for this call's work (" +
                 (err.empty() ? std::string("a kernel failed") : err) +
                 "; the next CUDA call in this process says more)",
             lock);
        break;
      }
      free_.push_back(c.start);
      free_.push_back(c.end);
      calls_.pop_front();
    }
    ErrorKind kind = ErrorKind::generic;
    std::string why;
    const double now = watchdog_now_s();
    if (!calls_.empty()) {
      Call& c = calls_.front();
      std::string err;
      if (c.started < 0 && h_.query(c.start, &err) != 0) c.started = now;
      if (c.started >= 0 && now - c.started > c.timeout_s) {
        kind = ErrorKind::timeout;
        char secs[32];
        std::snprintf(secs, sizeof secs, "%g", c.timeout_s);
        why = c.what + ": did not finish within its deadline (" + secs +
              " s from when it started on the GPU): a peer never joined it, or is stuck";
      }
    }
    // The hooks run without our lock: poll() may take the communicator's locks.
    const bool drained = calls_.empty();
    lock.unlock();
    ErrorKind pk = ErrorKind::generic;
    std::string polled = h_.poll(&pk);
    lock.lock();
    if (!polled.empty()) kind = pk, why = polled;  // the cause beats its symptom, the deadline
    if (!why.empty() && !fired_ && !stop_) {
      fire(kind, why, lock);
      continue;
    }
    if (fired_) continue;
    if (drained && calls_.empty()) {
      polled_after_drain_ = true;
      cv_.notify_all();
      continue;
    }
    cv_.wait_for(lock, std::chrono::duration<double>(interval_), [&] { return stop_; });
  }
}

}  // namespace plait
