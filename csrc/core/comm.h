// The one door into a communicator: what the C API (bindings/capi.h) and the Python bindings
// hold. A flat shared-memory Communicator (core/communicator.h) implements it; a communicator over
// several hosts implements the same calls, so a caller (the native torch backend, plait._C) never
// asks which one it drives. Host and device buffers cross it alike (core/call.h's Buffer).
//
// This header sees only the ground floor (call.h, errors.h, wakeup.h): no algorithm table, no
// segment layout, so a binding that includes it does not compile the transport's structs.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "core/call.h"
#include "core/errors.h"
#include "core/wakeup.h"

namespace plait {

// One asynchronous call: queued by Comm::call, finished once by the communicator that runs it.
class Task {
 public:
  explicit Task(const CallArgs& a) : args(a) {}
  // Waits up to timeout_s (nullopt: until finished; else seconds >= 0, InvalidArgument
  // otherwise); true when finished. Throws the call's error.
  bool wait(std::optional<double> timeout_s);
  bool done() const { return state_.load(std::memory_order_acquire) != 0; }
  // A deferred task (core/wakeup.h) that is not finished: has the progress thread start it now,
  // for callers that will not wait on it soon.
  void start() {
    if (wake_ && !done()) wake_->kick();
  }

  // Called once when the task finishes, on the thread that finished it (plait's progress
  // thread, or a waiter that ran the task itself): how callers complete their own futures
  // (the torch backend) without a thread of theirs waiting on each task.
  using Done = std::function<void(ErrorKind, const std::string&)>;
  using Reword = std::function<std::string(ErrorKind, const std::string&)>;

  CallArgs args;
  // A closure task (Communicator::submit): this body runs in the task's turn instead of args'
  // collective (args then only describe the call, for batching decisions and reports).
  std::function<void()> body;
  // A stepped send/recv (Communicator::submit_step): progressed without waiting, together with
  // the send/recv around it (core/p2p.cc's batches), until it returns kStepDone; kStepPending:
  // not yet; kStepLocal: it has set args.peer to a rank of this communicator and continues as
  // this communicator's own send/recv (a receive from any rank keeps matching by tag). Throws
  // PlaitError on failure. Runs on the thread that runs the batch, with the others' calls held.
  static constexpr int kStepPending = 0, kStepDone = 1, kStepLocal = 2;
  std::function<int(CallArgs&)> step;
  // Set by a layer above before the task can finish: rewrites an error's message (and may act
  // on it, e.g. abort other hosts) before waiters see it.
  Reword reword;
  // The peer a layer above reports (a multi-host communicator's global rank, where args.peer is
  // this host's); kNoPeer: args.peer.
  static constexpr int kNoPeer = -2;
  std::atomic<int> reported_peer{kNoPeer};
  int peer() const {
    const int p = reported_peer.load(std::memory_order_acquire);
    return p == kNoPeer ? args.peer : p;
  }
  // A send or recv (own or stepped): progressed in core/p2p.cc's batches, never alone.
  bool batched() const { return !body && (args.coll == Coll::send || args.coll == Coll::recv); }

 private:
  friend class Communicator;
  void finish(ErrorKind kind, std::string msg, std::shared_ptr<const std::string> flight = nullptr);
  Done on_done_;
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<int> state_{0};  // 0 pending, 1 ok, 2 failed
  ErrorKind kind_ = ErrorKind::none;
  std::string msg_;
  std::shared_ptr<const std::string> flight_;
  uint64_t deferred_ns_ = 0;      // queued without a wake-up at this time (core/wakeup.h)
  std::shared_ptr<Wakeup> wake_;  // kicked by a waiter of a deferred task
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual bool closed() const = 0;

  // Validates and runs (or queues) one call. Returns the Task for async calls, null otherwise.
  // Bad input aborts the communicator on every rank (every host), so no peer waits for a call
  // that will not come. timeout_s: the call's deadline (nullopt: the communicator's). Device
  // buffers are enqueued on their stream: "async" on the host, null is returned.
  virtual std::shared_ptr<Task> call(Coll c, const Buffer& in, const Buffer& out, RedOp op,
                                     int root, int peer, int64_t tag, const std::string& algo,
                                     std::optional<double> timeout_s, bool async,
                                     Task::Done on_done = nullptr) = 0;
  // Runs an async task on the calling thread when it is next in line and nothing runs (a caller
  // about to wait on it saves two thread hand-offs). True if the task is finished on return.
  virtual bool run_here(const std::shared_ptr<Task>& t) = 0;
  // Aborts the communicator on every rank with this error, then raises it here (input a caller
  // rejects before it reaches call()).
  [[noreturn]] virtual void fail(ErrorKind kind, const std::string& msg) = 0;
  // Finishes the queued calls, then stops the communicator (later calls fail); idempotent.
  virtual void finalize() = 0;

  // The name reports and traces give this communicator (the torch backend sets its group's).
  virtual void set_label(const std::string& label) = 0;
  virtual std::string label() const = 0;
};

}  // namespace plait
