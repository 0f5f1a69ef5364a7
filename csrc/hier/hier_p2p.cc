// send/recv on the multi-host communicator (hier/hier_comm.h).
//
// Every send and recv is a stepped task of this host's communicator (Communicator::submit_step,
// core/p2p.cc): it is progressed, never waited for alone, together with the send/recv queued
// around it, as a flat communicator's own are. So `irecv(peer); send(peer); wait()` on two ranks
// (batch_isend_irecv, a pipeline's exchange) cannot wait on each other, on one host or across.
// - A peer on this host: the first step turns the task into the local communicator's own
//   send/recv (args.peer becomes the host's rank; the task reports the global one).
// - A peer on another host: the world engine's p2p_start issues the transfer, later steps ask
//   p2p_test. An engine without them moves the message in one blocking call (the Python engine):
//   there, a receive must not wait for a send issued after it on the same rank. So does a
//   synchronous call with nothing else in flight on this rank (it has nothing to wait with).
// - From any rank: nothing is posted before the sender is known, so two candidates (one on this
//   host, one on another) are never both consumed. Each step asks this host's communicator
//   (ready_source: its channels and its stash) and the world engine's probe, alternating which
//   goes first so a busy side cannot starve the other; a local sender turns the task into a local
//   receive of that tag from it, a remote one into a named engine receive. Each (sender, tag)
//   pair's order holds.
// Errors: a step throws; the task's waiters see the message with this rank and host named, and
// the failure goes to every rank of every host (record_error), as a collective's does.
#include <cstdio>
#include <string>

#include "hier/hier_comm.h"

namespace plait {

struct HierComm::P2PState {
  bool begun = false;
  bool local = false;         // turned into the local communicator's own send/recv
  bool remote_begun = false;  // the engine transfer was issued (req: until it finished)
  void* req = nullptr;
  double start = 0, deadline = 0, next_health = 0;
  bool local_first = true;  // any-source: which side the next round asks first
  bool reported = false;    // its error was reworded (p2p_error) already
};

std::shared_ptr<Task> HierComm::p2p_call(const CallArgs& a, bool async, Task::Done on_done) {
  auto st = std::make_shared<P2PState>();
  auto step = [this, st](CallArgs& x) { return p2p_step(x, *st); };
  auto reword = [this, a, st](ErrorKind kind, const std::string& msg) {
    return p2p_error(a, *st, kind, msg);
  };
  if (!async) notify_long_wait();  // engines wait on the network: let other Python threads run
  try {
    return local_->submit_step(a, step, async, std::move(on_done), reword);
  } catch (const PlaitError& e) {  // a synchronous one: stepped on this thread, or waited for
    if (st->reported) throw;
    throw_error(e.kind(), p2p_error(a, *st, e.kind(), e.what()));
  }
}

int HierComm::p2p_step(CallArgs& x, P2PState& st) {
  if (!st.begun) {
    st.begun = true;
    st.start = now_s();
    st.deadline = st.start + x.timeout_s;
    st.next_health = st.start + 0.05;
    {
      std::unique_lock<std::mutex> lk(mu_);
      if (!first_error_.empty()) {
        lk.unlock();
        raise_aborted();
      }
    }
    if (x.peer != kAnySource && lay_.host_of[size_t(x.peer)] == lay_.h) {
      if (Task* t = Communicator::running_task()) t->reported_peer = x.peer;
      st.local = true;
      x.peer = lay_.local_of[size_t(x.peer)];
      return Task::kStepLocal;
    }
  }
  if (x.peer == kAnySource) return p2p_any(x, st);
  return p2p_remote(x, st);
}

int HierComm::p2p_remote(CallArgs& x, P2PState& st) {
  const size_t bytes = size_t(x.count) * dtype_size(x.dtype);
  const bool sending = x.coll == Coll::send;
  if (!st.remote_begun) {
    st.remote_begun = true;
    // A synchronous call stepped on its caller's thread with nothing else queued or running
    // (no task: core/p2p.cc) has no other transfer to keep moving: the engine's own blocking
    // call is its fastest way (gloo's waits in the calling thread, no hand-off to a waiter).
    if (!world_->can_start_p2p() || Communicator::running_task() == nullptr) {
      if (sending)
        world_->send(x.in, bytes, x.peer, int(x.tag), st.deadline);
      else
        world_->recv(x.out, bytes, x.peer, int(x.tag), st.deadline);
      return Task::kStepDone;
    }
    st.req = world_->p2p_start(sending, sending ? const_cast<void*>(x.in) : x.out, bytes, x.peer,
                               int(x.tag), st.deadline);
    if (!st.req) return Task::kStepDone;
  }
  if (!world_->p2p_test(st.req)) return Task::kStepPending;
  st.req = nullptr;
  return Task::kStepDone;
}

int HierComm::p2p_any(CallArgs& x, P2PState& st) {
  const size_t bytes = size_t(x.count) * dtype_size(x.dtype);
  const std::vector<int>& mine = lay_.hosts[size_t(lay_.h)];
  auto what = [&] {
    return "recv from any rank (tag=" + std::to_string(x.tag) + ", " + std::to_string(bytes) +
           " bytes, " + dtype_name(x.dtype) + ")";
  };
  for (int k = 0; k < 2; ++k) {
    if ((k == 0) == st.local_first) {
      if (mine.size() < 2) continue;
      const int lp = local_->ready_source(x.tag);
      if (lp < 0) continue;
      if (Task* t = Communicator::running_task()) t->reported_peer = mine[size_t(lp)];
      st.local = true;
      x.peer = lp;
      return Task::kStepLocal;
    }
    size_t sent = 0;
    const int src = world_->probe(int(x.tag), &sent);
    if (src < 0) continue;
    if (sent != PLAIT_ENGINE_UNKNOWN && sent != bytes)
      throw MismatchError("mismatched send/recv: " + what() + " matched a message of rank " +
                          std::to_string(src) + " on host " +
                          std::to_string(lay_.host_of[size_t(src)]) + " of " +
                          std::to_string(sent) + " bytes");
    x.peer = src;  // the task's args: what it reports as its source
    return p2p_remote(x, st);
  }
  st.local_first = !st.local_first;
  const double t = now_s();
  if (t >= st.next_health && mine.size() > 1) {  // the engine's probe looks at other hosts'
    st.next_health = t + 0.05;
    const std::string dead = local_->dead_peer();
    if (!dead.empty()) throw PeerLostError(what() + ": " + dead);
  }
  if (t >= st.deadline) {
    char secs[32];
    std::snprintf(secs, sizeof secs, "%.3g", t - st.start);
    throw TimeoutError(
        what() + ": deadline passed (" + secs + " s) with no message of this tag from any of the " +
        std::to_string(size_ - 1) + " other ranks (" + std::to_string(lay_.nhosts()) + " hosts, " +
        world_->engine() + " between them)");
  }
  return Task::kStepPending;
}

std::string HierComm::p2p_error(const CallArgs& a, P2PState& st, ErrorKind kind,
                                const std::string& msg) {
  st.reported = true;
  std::string m = msg;
  if (m.rfind("communicator aborted after an earlier error", 0) == 0) return m;
  if (st.local)  // the local communicator's words: its ranks are this host's
    m = "local " + std::string(coll_name(a.coll)) + " on host " + std::to_string(lay_.h) + ": " +
        m + " [" + lay_.describe_host(lay_.h) + "]";
  m = head(a) + (a.peer == kAnySource ? "" : " with rank " + std::to_string(a.peer)) + ": " + m;
  if (kind == ErrorKind::peer_lost) {
    // A lost peer is often the echo of a failure this host recorded first (see run_call).
    try {
      local_->throw_if_aborted();
    } catch (const PlaitError& cause) {
      return record_error(cause.kind(), head(a) + ": " + cause.what());
    }
  }
  return record_error(kind, m);
}

std::string HierComm::record_error(ErrorKind kind, const std::string& msg) {
  if (first_failure(kind, msg)) return msg;
  std::lock_guard<std::mutex> lk(mu_);
  return "communicator aborted after an earlier error: " + first_error_;
}

}  // namespace plait
