#include "core/wakeup.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/timerfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "core/errors.h"

namespace plait {

namespace {
// Idle timer periods before the timer stops: a burst of async calls keeps it running, so their
// issuer does not pay for arming it again (~6 us) every few calls.
constexpr int kIdleTicks = 4;

void set_period(int fd, uint64_t ns) {
  itimerspec its{};
  its.it_interval.tv_sec = time_t(ns / 1000000000u);
  its.it_interval.tv_nsec = long(ns % 1000000000u);
  its.it_value = its.it_interval;
  timerfd_settime(fd, 0, &its, nullptr);
}
}  // namespace

Wakeup::Wakeup(uint64_t grace_ns) : grace_ns_(grace_ns) {
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (grace_ns_) timer_fd_ = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  if (event_fd_ < 0 || (grace_ns_ && timer_fd_ < 0)) {
    const std::string why = std::strerror(errno);
    if (event_fd_ >= 0) close(event_fd_);
    throw PlaitError("cannot create the progress thread's wake-up descriptors: " + why);
  }
}

Wakeup::~Wakeup() {
  close(event_fd_);
  if (timer_fd_ >= 0) close(timer_fd_);
}

void Wakeup::kick(bool asleep) {
  urgent_.store(true, std::memory_order_release);
  if (!asleep) return;
  const uint64_t one = 1;
  (void)!write(event_fd_, &one, sizeof one);
}

void Wakeup::tick_on() {
  idle_ticks_ = 0;
  if (ticking_ || timer_fd_ < 0) return;
  set_period(timer_fd_, grace_ns_ / 2 ? grace_ns_ / 2 : 1);
  ticking_ = true;
}

void Wakeup::idle_tick() {
  if (!ticking_ || ++idle_ticks_ < kIdleTicks) return;
  set_period(timer_fd_, 0);
  ticking_ = false;
}

bool Wakeup::sleep() {
  pollfd fds[2] = {{event_fd_, POLLIN, 0}, {timer_fd_, POLLIN, 0}};
  while (poll(fds, 2, -1) < 0 && errno == EINTR) {
  }
  uint64_t n;  // read only what is ready: each read is a syscall on the hand-off's path
  if (fds[0].revents) (void)!read(event_fd_, &n, sizeof n);
  return fds[1].revents && read(timer_fd_, &n, sizeof n) == ssize_t(sizeof n);
}

}  // namespace plait
