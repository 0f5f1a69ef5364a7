// The stream queue: the GPU half of the communicator (core/device.h), one for every GPU
// transport. It enqueues a checked call on the caller's CUDA stream through its transport
// (transport/device.h), orders calls (each waits for the previous one's end: transports require
// it and share scratch), keeps the first error for every rank, and runs a watchdog thread
// (core/watchdog.h) that follows every call in flight, waited on or not, so a call whose peer
// died or whose deadline passed is aborted on every rank even if nobody waits for it.
// Errors abort the host communicator on every rank (GpuPeers), whose abort every rank's queue
// watches in turn; a queue that failed raises its first error from every later call.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "core/device.h"
#include "core/watchdog.h"
#include "transport/device.h"

namespace plait {

// A GPU queue as a pending event sees it.
class GpuWork {
 public:
  virtual ~GpuWork() = default;
  virtual int device() const = 0;
  virtual double default_timeout() const = 0;
  // While work is pending (any thread): throws the queue's error, a peer's abort, or, past
  // `deadline`, a TimeoutError after aborting the queue.
  virtual void poll_pending(double deadline) = 0;
  // Once the work has run: throws an error the GPU reported (e.g. a kernel that gave up).
  virtual void check_done() = 0;
};

// Completion of the calls enqueued up to a point on one stream.
class GpuEvent {
 public:
  GpuEvent(std::shared_ptr<GpuWork> q, cudaStream_t s, double timeout_s);
  ~GpuEvent();
  // Polls until done, the wait's own timeout (false) or the calls' deadline (TimeoutError, after
  // aborting the queue). Throws the queue's error.
  bool wait(double timeout_s);
  bool done();
  // Makes `stream` wait for the calls on the GPU and returns at once (torch's Work.wait() for
  // CUDA); throws an error already recorded. The watchdog enforces the deadline.
  void block(cudaStream_t stream);

 private:
  std::shared_ptr<GpuWork> q_;
  cudaEvent_t ev_ = nullptr;
  double deadline_;
};

// Throws InvalidArgument when `stream` is being captured into a CUDA graph: the calls' epochs,
// deadlines and events would be baked into the graph and replay wrong.
void refuse_capture(cudaStream_t stream, const std::string& who, Coll c);
// cudaErrorStreamCapture*: another thread's capture refused a call; not a failure of the GPU.
bool is_capture_error(cudaError_t e);
// The watchdog hooks for CUDA events on `device`.
Watchdog::Hooks cuda_event_hooks(int device);
double gpu_now_s();
double gpu_watchdog_interval_s();  // how often a watchdog polls while calls are in flight
void gpu_pause(double waited_s);   // spin, then yield, then 100 us naps
void cuda_ok(cudaError_t e, const std::string& what);  // throws PlaitError

// The caller's current device is restored after plait's work (torch and cupy keep their own).
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int d);
  ~DeviceGuard();
};

class StreamQueue final : public DeviceQueue, public GpuWork {
 public:
  // Connects the transport (a collective over the ranks) within timeout_s.
  StreamQueue(std::unique_ptr<DeviceTransport> tp, int rank, int size, int device, double timeout_s,
              const std::string& algo_override, GpuPeers peers);
  ~StreamQueue() override;

  const char* transport() const override { return tp_->name(); }
  Caps caps() const override { return tp_->caps(); }
  void finalize() override;
  std::string handle() const { return tp_->handle(); }
  void open(const std::vector<std::string>& handles);

  int device() const override { return device_; }
  double default_timeout() const override { return timeout_s_; }
  void poll_pending(double deadline) override;
  void check_done() override;

 protected:
  void throw_if_failed() override;
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg) override;
  void enqueue(const Algorithm& alg, const CallArgs& a, uintptr_t stream) override;

 private:
  [[noreturn]] void fail_locked(ErrorKind kind, const std::string& msg);  // call_mu_ held
  void throw_if_failed_locked();  // call_mu_ held: ends the transport's work if another
                                  // thread recorded an error but could not
  void record(ErrorKind kind, const std::string& msg);       // first error, for every rank
  void abort_async(ErrorKind kind, const std::string& msg);  // any thread; no throw
  void poll_once(const std::string& what);  // call_mu_ held: the call's deadline, peers' abort
  void run(const Algorithm& alg, const CallArgs& a, const std::string& what, cudaStream_t s);
  std::string watch_poll(ErrorKind* kind);  // the watchdog's poll hook
  std::string who() const;                  // "rank 0 (GPU 1, NCCL 2.27.3)"
  [[noreturn]] void throw_first();
  // call_mu_ as every holder takes it: on release, an abort that another thread asked for while
  // the lock was held (abort_async's try_lock failed) is carried out, so it is never lost.
  class CallLock {
   public:
    explicit CallLock(StreamQueue* q, bool try_only = false);
    ~CallLock();
    bool owns() const { return owns_; }

   private:
    StreamQueue* q_;
    bool owns_;
  };
  void run_pending_abort();  // after releasing call_mu_
  // The stream the transport enqueues a call on: the caller's, or the relay when the transport
  // launches from another thread and the caller's is the per-thread default stream.
  cudaStream_t relay_for(cudaStream_t s);

  std::unique_ptr<DeviceTransport> tp_;
  GpuPeers peers_;
  cudaEvent_t last_ = nullptr;  // the last call's end: the next call's stream waits for it
  std::mutex call_mu_;          // the issuing thread; the transport is used only under it
  std::atomic<bool> abort_pending_{false};  // an abort waiting for call_mu_'s holder
  cudaStream_t relay_ = nullptr;            // see relay_for; created at first use
  cudaEvent_t handoff_ = nullptr;           // the caller's stream, up to the call, for relay_
  mutable std::mutex err_mu_;               // first_error_, cur_
  std::atomic<bool> failed_{false};
  bool finalized_ = false;
  std::string first_error_;
  ErrorKind first_kind_ = ErrorKind::generic;  // raised again by every later call
  std::string cur_ = "init";                   // the call being enqueued, for messages
  double deadline_ = 0;                        // of the call being enqueued
  std::unique_ptr<Watchdog> wd_;               // stopped first: its hooks use this queue
};

}  // namespace plait
