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

#include "transport/table.h"

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

  // A few bytes that travel with a channel-0 post (on the same cache line): writing them before
  // post(0, s) and reading a peer's after wait_post(peer, 0, s) costs no transfer of its own.
  // inline_bytes() is 0 where the transport has none.
  virtual unsigned char* inline_slot(int r) { return nullptr; }
  virtual size_t inline_bytes() const { return 0; }

  // Single copy: reading a peer's own buffers, not a staged copy of them (Linux cross-memory
  // attach on shared memory). Available to a call only when every rank of the communicator can
  // read every peer, which all ranks agree on before their first call.
  virtual bool can_read_peers() const { return false; }
  // What this transport offers algorithms now (transport/table.h): host staging, and peer_read
  // while can_read_peers(). Its entry in the transport table says what it can ever offer.
  Caps caps() const { return kCapHostStaging | (can_read_peers() ? Caps(kCapPeerRead) : Caps(0)); }
  // Publishes this call's input and output addresses; peers may use them once this rank has
  // posted anything on channel 0 of the call. A rank must not return (or touch what peers read)
  // until its readers say they are done.
  virtual void expose(const void* in, void* out) {}
  // The addresses peer p exposed in this call (after a wait_post on p).
  virtual const char* peer_in(int p) { return nullptr; }
  virtual const char* peer_out(int p) { return nullptr; }
  // Copies `bytes` from address `src` in peer p's memory to local `dst`; throws on failure.
  virtual void read_peer(int p, void* dst, const char* src, size_t bytes) {}
  // Copies `bytes` from local `src` to address `dst` in peer p's memory; throws on failure.
  // `stream`: nobody here reads dst again soon (a hint for copies that can bypass the cache).
  virtual void write_peer(int p, char* dst, const void* src, size_t bytes, bool stream = false) {}
  // A local address of [remote, remote + bytes) in peer p's memory, when that range lies in a
  // plait shared buffer (plait.empty) this rank could map; else nullptr. Counts as `bytes`
  // moved through a mapping (mapped_bytes).
  virtual char* peer_local(int p, const char* remote, size_t bytes) { return nullptr; }
  // Whether peer_local would give that range (mapping it now), without counting any bytes.
  virtual bool peer_maps(int p, const char* remote, size_t bytes) { return false; }
  virtual uint64_t mapped_bytes() const { return 0; }

 protected:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace plait
