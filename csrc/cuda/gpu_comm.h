// The GPU communicator: one NCCL communicator (non-blocking, so every wait has a deadline), the
// GPU algorithm table and plait's kernels, working on the caller's CUDA stream. A call validates
// its buffers, selects an algorithm and enqueues it; the host blocks only in wait().
// It lives beside a CPU Communicator of the same ranks: errors abort both on every rank (the CPU
// segment carries the abort to peers, whose GPU waits watch it), so no rank waits for a dead one
// past its deadline.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <memory>
#include <string>

#include "algo/gpu_algo.h"
#include "core/errors.h"
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

// Hooks into the CPU communicator of the same ranks.
struct GpuPeers {
  std::function<void()> throw_if_aborted;                     // the abort some rank recorded
  std::function<void(ErrorKind, const std::string&)> fail;  // record one (may throw; ignored)

  // Records the error for the CPU communicator's ranks, then raises it here (the CPU
  // communicator reports an abort by throwing too: ours is the error to raise).
  [[noreturn]] void tell_and_throw(ErrorKind kind, const std::string& msg) const {
    try {
      if (fail) fail(kind, msg);
    } catch (const std::exception&) {
    }
    throw_error(kind, msg);
  }
};

// A GPU communicator (NCCL or CUDA IPC) as a pending event sees it.
class GpuWork {
 public:
  virtual ~GpuWork() = default;
  virtual int device() const = 0;
  virtual double default_timeout() const = 0;
  // While work is pending: throws the communicator's error, a peer's abort, or, past `deadline`,
  // a TimeoutError after aborting the communicator.
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

 private:
  std::shared_ptr<GpuWork> comm_;
  cudaEvent_t ev_ = nullptr;
  double deadline_;
};

// The checks every GPU call makes (sizes, dtype, devices, overlap, root, peer); throws
// InvalidArgument. reduce takes no output on a non-root, send none, recv no input (present false).
void validate_gpu_call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root, int peer, int rank,
                       int size, int device);
// The call as the algorithms see it (count: elements of the whole vector, as on the CPU path).
CallArgs gpu_call_args(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root, int peer);
double gpu_now_s();
void gpu_pause(double waited_s);  // spin, then yield, then 100 us naps

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
  void all_reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op) override;
  void reduce_scatter(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op) override;
  void all_gather(const void* in, void* out, size_t bytes) override;
  void broadcast(const void* in, void* out, size_t bytes, int root) override;
  void reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op, int root) override;

 private:
  void check(nccl::Result r, const std::string& what);
  nccl::Result settle(const std::string& what);  // polls a non-blocking communicator
  void poll_once(const std::string& what);       // the call's deadline and peers' abort
  void poll_once(const std::string& what, double deadline);
  void release();
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg);
  void throw_if_failed();
  const GpuAlgorithm& select(Coll c, const std::string& algo);
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
  std::mutex abort_mu_;            // comm_ and first_error_ against a concurrent fail()
  std::atomic<bool> failed_{false};
  std::string first_error_;
  // The call in progress (for messages and deadlines).
  CallArgs cur_;
  const char* cur_algo_ = "";
  cudaStream_t stream_ = nullptr;
  double deadline_ = 0;
};

}  // namespace plait
