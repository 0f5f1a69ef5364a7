// A communicator: one shared-memory segment, one progress thread, calls executed in issue order.
// Calls on GPU buffers take the same path (validate -> select -> check -> run) and are enqueued
// on the caller's CUDA stream by the GPU transport's queue attached to it (core/device.h).
// Each call is validated (bad input aborts the communicator on every rank, so no peer hangs),
// an algorithm is selected, and it runs either inline on the caller's thread (a synchronous
// call with nothing queued) or on the progress thread (asynchronous calls, and anything issued
// behind them). Consecutive send/recv calls are progressed together, so exchanges between
// pairs of ranks never deadlock on ordering.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "algo/algo.h"
#include "core/comm.h"
#include "core/device.h"
#include "core/errors.h"
#include "core/flight.h"
#include "core/trace.h"
#include "core/wakeup.h"
#include "transport/shm.h"

namespace plait {

// Deadlines are seconds >= 0: 0 has passed when the wait starts (a wait fails unless its peer is
// already there), inf never passes (peers' liveness is still checked). NaN and negative values
// are refused with InvalidArgument, never read as "no deadline".
struct Options {
  double timeout_s = 300;
  std::string algo_override;  // PLAIT_ALGO: "ring" or "allreduce=ring,allgather=direct"
  bool oversubscribed = false;
  double init_timeout_s = 300;
  // Each rank's pid as the rendezvous announced it (0: unknown, e.g. on another pid namespace):
  // lets init notice a rank that died before its progress thread went live.
  std::vector<int32_t> peer_pids;
};

// The PLAIT_* settings a Communicator reads (PLAIT_ALGO, PLAIT_ASYNC_*), checked without one:
// init calls it before the rendezvous so a bad value fails every rank at once, not one mid-join.
void check_env();

class Communicator final : public Comm {
 public:
  Communicator(std::shared_ptr<Segment> seg, int rank, const Options& opt);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const override { return rank_; }
  // Whether single-copy algorithms can run here, and if not, why.
  bool single_copy() const { return tp_.can_read_peers(); }
  uint64_t mapped_bytes() const { return tp_.mapped_bytes(); }
  std::string single_copy_unavailable() const {
    return single_copy() ? "" : tp_.read_unavailable();
  }
  int size() const override { return size_; }
  bool closed() const override { return closed_; }

  // Validates and runs (or queues) one call. Returns the Task for async calls, null otherwise.
  // GPU buffers (Device::cuda) go to the attached DeviceQueue, enqueued on their stream: always
  // "async" on the host (null is returned; completion is the stream's).
  // timeout_s: the call's deadline (nullopt: the communicator's); a bad one aborts the call on
  // every rank, as any invalid argument does.
  std::shared_ptr<Task> call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root,
                             int peer, int64_t tag, const std::string& algo,
                             std::optional<double> timeout_s, bool async,
                             Task::Done on_done = nullptr) override;
  bool run_here(const std::shared_ptr<Task>& t) override;
  // Closure tasks: queues body as one task in this communicator's issue order, so a layer above
  // (the multi-host communicator, hier/hier_comm.h) runs one call as one task on this progress
  // thread. async: returns the Task (deferred: left to its waiter for the grace period, as a small
  // async collective is). Sync with nothing queued: runs on the caller's thread; else waits for
  // it. The body's PlaitError is the task's error (sync: thrown here as it is; this
  // communicator's own abort state is untouched). Calls this communicator gets from inside a
  // running body run inline on that thread, never queued behind the body.
  std::shared_ptr<Task> submit(const CallArgs& a, std::function<void()> body, bool async,
                               bool deferred, Task::Done on_done = nullptr);
  // Stepped send/recv (Task::step): a layer above that moves a message by other means (the
  // multi-host communicator's engine between hosts) queues it here in issue order, and it is
  // progressed together with the send/recv around it, never waited for alone, so an irecv
  // followed by a send cannot wait on each other. Sync with nothing queued: stepped on the
  // caller's thread (its PlaitError thrown as it is); else queued and waited for. reword: see
  // Task::reword.
  std::shared_ptr<Task> submit_step(const CallArgs& a, std::function<int(CallArgs&)> step,
                                    bool async, Task::Done on_done = nullptr,
                                    Task::Reword reword = nullptr);
  // Whether the calling thread runs one of this communicator's closure tasks now.
  bool inside_body() const { return tl_inside_ == this; }
  // The task whose body this thread runs now (null outside a body, and for a synchronous call's
  // body run on its caller's thread): a body may fill in its task's args (an any-source recv's
  // sender) before the task finishes.
  static Task* running_task() { return tl_task_; }
  // From inside a closure task's body only (InvalidArgument elsewhere): the rank whose next
  // message of tag a recv(rank, tag) would take now, or -1 while there is none. Never waits;
  // consumes nothing. Like a receive from any rank, it sets aside (stashes) a head message of
  // another tag that stands in the way, so later messages become visible.
  int ready_source(int64_t tag);
  // Aborts the communicator on every rank with this error (used for input the Python layer
  // rejects before it reaches call()).
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg) override;
  // The GPU transport's queue GPU calls are enqueued on (created by the first GPU call, once every
  // rank agreed on the transport: plait._gpu). Attaching twice is refused.
  void attach_device(std::shared_ptr<DeviceQueue> q);
  std::shared_ptr<DeviceQueue> device_queue();
  // Throws the communicator-wide abort if any rank recorded one. Reads only the shared segment,
  // so other threads may call it (the GPU communicator polls it while it waits).
  void throw_if_aborted() { tp_.throw_if_aborted(); }
  // Records an abort for every rank without raising here or touching this rank's own state, so
  // any thread may call it (the GPU watchdog); this rank's next call raises it.
  void abort_all(ErrorKind kind, const std::string& msg) {
    try {
      tp_.fail(kind, msg);
    } catch (const PlaitError&) {
    }
  }
  // "rank p (pid ...) died" for the first peer that died (not one that left in order), or "".
  // Reads only the shared segment, like throw_if_aborted (a GPU watchdog polls it).
  std::string dead_peer();
  void finalize() override;

  // Flight recorder and trace (core/flight.h, core/trace.h). The label names this communicator
  // in reports and as the trace's track (the torch backend sets its process group's name).
  void set_label(const std::string& label) override;
  std::string label() const override;
  std::string flight_json();                   // every rank's last calls, as plait.dump writes them
  void flight_scribble(int r, uint64_t seed);  // test hook: garbage into rank r's ring

 private:
  struct P2P {
    CallArgs* a;
    std::shared_ptr<Task> task;                    // null for an inline call
    std::function<int(CallArgs&)>* ext = nullptr;  // a stepped one's step, until it turns local
    bool any = false;  // a receive from any rank that a step turned local: still matches by tag
    bool started = false;
    bool stashing = false;  // copies a message into the stash (Stash::p)
    uint64_t msg = 0, first = 0, nchunks = 0, done = 0;
    double deadline = 0;
    uint64_t rec = 0, t0 = 0, idle0 = 0;  // flight record, start, batch idle time at start
  };

  static P2P op_of(const std::shared_ptr<Task>& t) {  // a queued send/recv task's batch entry
    P2P p{&t->args, t};
    if (t->step) p.ext = &t->step;
    return p;
  }

  // A message no posted async recv wanted when it reached the head of its channel: copied
  // aside so later messages can reach their receivers (receives match by (sender, tag)).
  struct Stash {
    CallArgs a;
    std::vector<char> buf;
    P2P p{&a, nullptr, nullptr, false, false, true};
  };

  CallArgs validate(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
                    int64_t tag, const std::string& algo, std::optional<double> timeout_s);
  int resolve_algo(Coll c, const std::string& name, size_t bytes);
  void call_device(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
                   int64_t tag, const std::string& algo, std::optional<double> timeout_s);
  // Compares a GPU call (enqueued on a stream, not run here) with the same call number on the
  // other ranks without waiting for them (core/call_check.cc); a disagreement aborts the
  // communicator on every rank with MismatchError naming both ranks' calls. The call is then
  // kept in the flight recorder as enqueued over NCCL (or CUDA IPC when ipc).
  void check_gpu_call(const CallArgs& a, const char* algo, bool ipc, int device);
  void run(CallArgs& a);  // one collective, on whichever thread holds exec_mu_
  // A closure task's body, marked as running here for calls it makes (exec_mu_ held); its error
  // as (kind, message).
  void run_body(Task& t, ErrorKind* kind, std::string* msg);
  // One validated call on this thread, which holds exec_mu_ (a sync call with nothing queued, or
  // a step of a closure task); its error is raised as rethrow raises it.
  void run_now(CallArgs& a);
  static thread_local const Communicator* tl_inside_;
  static thread_local Task* tl_task_;
  // Marks the calling thread as running one of c's closure tasks until the scope ends (exceptions
  // included), so the calls the body makes run inline.
  class InsideBody {
   public:
    // t: the task whose body runs (null: a synchronous call's, run on its caller's thread).
    InsideBody(const Communicator* c, Task* t) : prev_(tl_inside_), prev_task_(tl_task_) {
      tl_inside_ = c;
      tl_task_ = t;
    }
    ~InsideBody() {
      tl_inside_ = prev_;
      tl_task_ = prev_task_;
    }
    InsideBody(const InsideBody&) = delete;
    InsideBody& operator=(const InsideBody&) = delete;

   private:
    const Communicator* prev_;
    Task* prev_task_;
  };
  void run_local(const CallArgs& a);
  // Progresses a batch of send/recv until every one is done. A batch of tasks that cannot move
  // while a collective or closure task waits at the queue's head is set aside (parked_) instead:
  // that call runs, moving the parked ones in its waits, and the batch resumes after it.
  void run_p2p(std::vector<P2P>& ops);
  // One pass over ops; true if anything moved. in_wait: from a collective's wait (the transport's
  // idle hook): no stepped ones, and finished ones stay in ops for run_p2p to report.
  bool p2p_round(std::vector<P2P>& ops, bool in_wait);
  void p2p_done(P2P& op, ErrorKind kind, const std::string& msg,
                const std::shared_ptr<const std::string>& flight);
  bool other_task_next();  // a collective or closure task heads the queue
  void progress_parked();  // the transport's idle hook
  bool p2p_step(P2P& op);
  int take_stashed(P2P& op);
  int any_source(
      const CallArgs& a);  // 1 copied from the stash, 0 none there, -1 there but incomplete
  bool stash_head(int peer, const std::vector<P2P>& ops);
  void progress_loop();
  // Queues t for the progress thread; deferred: without waking it (core/wakeup.h).
  void enqueue(const std::shared_ptr<Task>& t, bool deferred = false);
  // The progress thread's next task, sleeping until there is one it should take; null at stop.
  // busy: the thread ran a task since it last slept (it then takes deferred tasks at once).
  std::shared_ptr<Task> next_task(bool busy);
  // PLAIT_ASYNC_GRACE_US and PLAIT_ASYNC_DEFER_BYTES (core/wakeup.h): makes wake_.
  void read_async_policy();
  void wait_for_all_ranks(double timeout_s);
  bool starting_rank_died(int p, std::string* why) const;
  [[noreturn]] void rethrow(const PlaitError& e);
  // Ends a call's flight record and trace slice.
  void recorded(const CallArgs& a, uint64_t rec, uint64_t call, const char* algo, uint64_t t0,
                uint64_t wait_ns, bool ok);
  // For a timeout, lost peer or mismatch: the flight report, with its summary (or where it was
  // written, under plait-run --dump-on-error) appended to msg. Null for other errors.
  std::shared_ptr<const std::string> annotate(ErrorKind kind, std::string* msg);
  std::vector<std::string> peer_states();

  std::shared_ptr<Segment> seg_;
  int rank_, size_;
  Options opt_;
  WaitPolicy policy_;
  ShmTransport tp_;
  AlgoOverride override_;  // PLAIT_ALGO
  uint64_t seq_ = 0;
  std::atomic<uint64_t> gpu_seq_{0};  // GPU calls checked (check_gpu_call)
  std::mutex dev_mu_;
  std::shared_ptr<DeviceQueue> dev_;  // GPU calls' queue; null until the first GPU call
  bool reported_abort_ = false;
  std::string first_error_;
  bool closed_ = false;

  std::vector<uint64_t> send_chunk_, send_msg_, recv_chunk_, recv_msg_;
  std::vector<std::list<Stash>> stash_;  // per sender, in arrival order
  std::vector<uint8_t> rx_busy_;         // per sender: a message is being copied out
  uint64_t p2p_idle_ns_ = 0;             // time run_p2p spent waiting, for trace slices
  std::vector<uint8_t> p2p_busy_;        // per channel and direction: taken in this round
  // Tasks' send/recv set aside while a collective or closure runs (progress thread, exec_mu_).
  std::vector<P2P> parked_;

  FlightRecorder flight_;
  std::unique_ptr<Trace> trace_;
  mutable std::mutex label_mu_;
  std::string label_;

  std::mutex exec_mu_;  // held while a call executes
  std::mutex q_mu_;
  std::shared_ptr<Wakeup> wake_;
  bool sleeping_ = false;  // the progress thread sleeps or is about to (q_mu_)
  // Async calls still to start at once (not deferred), since the progress thread last had to
  // start one its caller left beyond the grace (q_mu_).
  int eager_calls_ = 0;
  size_t defer_max_bytes_ = kDeferMaxBytes;  // larger async calls start at once
  static constexpr int kEagerCalls = 64;
  std::deque<std::shared_ptr<Task>> queue_;
  std::atomic<int> pending_{0};  // queued or running on the progress thread
  bool stop_ = false;
  std::thread thread_;
  std::mutex ready_mu_;
  std::condition_variable ready_cv_;
  int ready_ = 0;  // 1 once the progress thread holds its liveness lock, -1 if it failed
};

}  // namespace plait
