// The interface every algorithm programs against: per-rank staging memory that all peers of the
// call can read, and monotonic step flags to order writes and reads of it. Shared memory between
// processes implements it today (shm.cc); a CUDA IPC transport fits the same shape.
//
// Rules an algorithm follows:
// - It writes only its own staging(rank()) and reads any staging(peer).
// - post(ch, s) publishes everything written before it; wait_post(peer, ch, s) returns once
//   the peer has posted step s (or later) on channel ch. Steps are per call, counted from 1, and
//   must rise monotonically per channel (the transport adds the call's epoch).
// - ack/wait_ack tell a writer that readers are done with a slot, so it may be reused.
// - Staging written in one call is never overwritten by the next call before every peer has
//   finished the call that read it: the transport alternates halves and checks that for you.
#pragma once
#include <cstddef>
#include <cstdint>

namespace plait {

class Transport {
 public:
  static constexpr int kChannels = 2;
  virtual ~Transport() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }

  virtual char* staging(int r) = 0;
  virtual size_t staging_bytes() const = 0;

  virtual void post(int channel, int64_t step) = 0;
  virtual void wait_post(int peer, int channel, int64_t step) = 0;
  virtual void ack(int channel, int64_t step) = 0;
  virtual void wait_ack(int peer, int channel, int64_t step) = 0;  // no-op for step <= 0

  // Waits until every other rank posted step s on channel ch.
  void wait_post_all(int channel, int64_t step) {
    for (int p = 0; p < size_; ++p)
      if (p != rank_) wait_post(p, channel, step);
  }
  void wait_ack_all(int channel, int64_t step) {
    for (int p = 0; p < size_; ++p)
      if (p != rank_) wait_ack(p, channel, step);
  }

 protected:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace plait
