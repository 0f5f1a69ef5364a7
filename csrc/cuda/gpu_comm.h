// The GPU communicator: one NCCL communicator (non-blocking, so every wait has a deadline), the
// GPU algorithm table and plait's kernels, working on the caller's CUDA stream. A call validates
// its buffers, selects an algorithm and enqueues it; the host blocks only in wait().
// It lives beside a CPU Communicator of the same ranks: errors abort both on every rank (the CPU
// segment carries the abort to peers, whose GPU waits watch it), so no rank waits for a dead one
// past its deadline. A watchdog thread per communicator (core/watchdog.h) follows every call in
// flight, waited on or not, so a synchronous call whose peer died is aborted too.
// One thread issues at a time (call_mu_); the watchdog and waiting threads touch the NCCL
// communicator only under it (try_lock: an issuing thread polls it itself), so an abort never
// frees it under another NCCL call.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
#include "core/watchdog.h"
#include "cuda/nccl_loader.h"

namespace plait {

// A device array as it crosses the binding.
struct GpuBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DType dtype = DType::f32;
  int device = -1;
  bool present = false;
};

struct GpuOptions {
  double timeout_s = 300;
  int64_t chunk_bytes = 4 << 20;  // PLAIT_GPU_CHUNK_BYTES; not measured on a GPU yet
  std::string algo_override;      // PLAIT_GPU_ALGO: "ring" or "allreduce=tree,allgather=nccl"
};

// A GPU communicator (NCCL or CUDA IPC) as a pending event sees it.
class GpuWork {
 public:
  virtual ~GpuWork() = default;
  virtual int device() const = 0;
  virtual double default_timeout() const = 0;
  // While work is pending (any thread): throws the communicator's error, a peer's abort, or, past
  // `deadline`, a TimeoutError after aborting the communicator.
  virtual void poll_pending(double deadline) = 0;
  // Once the work has run: throws an error the GPU reported (e.g. a kernel that gave up).
  virtual void check_done() = 0;
};

// Completion of the calls enqueued up to a point on one stream.
class GpuEvent {
 public:
  GpuEvent(std::shared_ptr<GpuWork> comm, cudaStream_t s, double timeout_s);
  ~GpuEvent();
  // Polls until done, the wait's own timeout (false) or the calls' deadline (TimeoutError, after
  // aborting the communicator). Throws the communicator's error.
  bool wait(double timeout_s);
  bool done();
  // Makes `stream` wait for the calls on the GPU and returns at once (torch's Work.wait() for
  // CUDA); throws an error already recorded. The watchdog enforces the deadline.
  void block(cudaStream_t stream);

 private:
  std::shared_ptr<GpuWork> comm_;
  cudaEvent_t ev_ = nullptr;
  double deadline_;
};

// Throws InvalidArgument when `stream` is being captured into a CUDA graph: the calls' epochs,
// deadlines and events would be baked into the graph and replay wrong.
void refuse_capture(cudaStream_t stream, const std::string& who, Coll c);
// The watchdog hooks for CUDA events on `device`.
Watchdog::Hooks cuda_event_hooks(int device);
// The name `algo` ("auto", "", or a name) resolves to for collective c; throws InvalidArgument.
const char* resolve_gpu_algo(Coll c, const std::string& algo,
                             const std::vector<std::string>& forced,
                             const std::string& override_text, int rank);
const char* resolve_ipc_algo(Coll c, const std::string& algo, int rank);

// The checks every GPU call makes (sizes, dtype, devices, overlap, root, peer); throws
// InvalidArgument. reduce takes no output on a non-root, send none, recv no input (present false).
void validate_gpu_call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root,
                       int peer, int rank, int size, int device);
// The call as the algorithms see it (count: elements of the whole vector, as on the CPU path).
CallArgs gpu_call_args(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root,
                       int peer);
double gpu_now_s();
double gpu_watchdog_interval_s();  // how often a watchdog polls while calls are in flight
void gpu_pause(double waited_s);   // spin, then yield, then 100 us naps

// The caller's current device is restored after plait's work (torch and cupy keep their own).
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int d);
  ~DeviceGuard();
};

class GpuComm final : public GpuOps, public GpuWork {
 public:
  GpuComm(const NcclApi& api, const nccl::UniqueId& id, int rank, int size, int device,
          const GpuOptions& opt, GpuPeers peers);
  ~GpuComm() override;
  GpuComm(const GpuComm&) = delete;
  GpuComm& operator=(const GpuComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const override { return device_; }
  double default_timeout() const override { return opt_.timeout_s; }
  void poll_pending(double deadline) override;
  void check_done() override {}
  const char* resolve(Coll c, const std::string& algo) const {
    return resolve_gpu_algo(c, algo, forced_, opt_.algo_override, rank_);
  }

  // Validates and enqueues one collective on `stream`; timeout_s < 0: the default. root is
  // broadcast's and reduce's, peer send's and recv's.
  void call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, const std::string& algo,
            cudaStream_t stream, double timeout_s, int root = 0, int peer = -1);
  // Waits (deadline) for everything enqueued, then destroys the NCCL communicator.
  void finalize();

  // GpuOps, for the algorithms.
  void group_start() override;
  void group_end() override;
  void send(const void* buf, size_t bytes, int peer) override;
  void recv(void* buf, size_t bytes, int peer) override;
  void all_reduce(const void* in, void* out, size_t count, nccl::DataType t,
                  nccl::RedOp op) override;
  void reduce_scatter(const void* in, void* out, size_t count, nccl::DataType t,
                      nccl::RedOp op) override;
  void all_gather(const void* in, void* out, size_t bytes) override;
  void broadcast(const void* in, void* out, size_t bytes, int root) override;
  void reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op,
              int root) override;

 private:
  void check(nccl::Result r, const std::string& what);
  nccl::Result settle(const std::string& what);  // polls a non-blocking communicator
  void poll_once(const std::string& what);       // the call's deadline and peers' abort
  void poll_once(const std::string& what, double deadline);
  void release();
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg);  // the issuing thread (call_mu_)
  void record(ErrorKind kind, const std::string& msg);  // first error, for every rank; no throw
  void abort_async(ErrorKind kind, const std::string& msg);  // any other thread; no throw
  void abort_nccl();                                         // call_mu_ held
  void throw_if_failed();  // call_mu_ held: aborts NCCL if another thread could not
  std::string watch_poll(ErrorKind* kind);  // the watchdog's poll hook
  std::string who() const;

  const NcclApi& api_;
  nccl::Comm comm_ = nullptr;
  int rank_, size_, device_;
  GpuOptions opt_;
  GpuPeers peers_;
  std::vector<std::string> forced_;  // per collective, from algo_override
  char* scratch_ = nullptr;
  int64_t scratch_bytes_ = 0;
  cudaEvent_t last_ = nullptr;  // recorded after every call: the next call's stream waits for it
  std::mutex call_mu_;          // the issuing thread; comm_ is used only under it
  std::mutex abort_mu_;         // first_error_
  std::atomic<bool> failed_{false};
  std::string first_error_;
  ErrorKind first_kind_ = ErrorKind::generic;  // raised again by every later call
  std::unique_ptr<Watchdog> wd_;               // last member but the call state: stopped first
  // The call in progress (for messages and deadlines).
  CallArgs cur_;
  const char* cur_algo_ = "";
  cudaStream_t stream_ = nullptr;
  double deadline_ = 0;
};

}  // namespace plait
