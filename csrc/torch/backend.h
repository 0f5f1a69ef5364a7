// The torch.distributed backend "plait" as a c10d::Backend: torch's collectives become calls of
// plait's C API (bindings/capi.h) on one communicator, with no Python and no GIL on the way.
// An Op is one torch call: the plait calls it issued, the steps to run once they finish (copy a
// temporary back into a non-contiguous output, divide for an integer AVG, ...) and the Future
// its Work hands out. plait's progress thread reports each call's end; the last one completes
// the Op (on the backend's completion thread, so Future callbacks never block plait's queue).
// An Op on CUDA tensors (gpu.cc) instead enqueues its calls on the current stream of the tensors'
// device and completes as c10d's NCCL backend does: its Work follows an event recorded on that
// stream after the calls.
#pragma once
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bindings/capi.h"

namespace plait_torch {

// Error kinds beyond plait's own (capi.h's codes): torch allows it, this backend does not do it.
constexpr uint32_t kUnsupported = 100;
// Tag of the send/recv calls that build all-to-all, gather and scatter (out of users' way); error
// texts show it as "plait's internal tag", not as the number nobody passed.
constexpr int64_t kInternalTag = 0x706C616974000000LL;
constexpr uint32_t kTimeout = PLAIT_E_TIMEOUT;

// plait's dtype code (capi.h PLAIT_F32, ...) of a torch dtype; -1 where plait has none.
int dtype_code(at::ScalarType s);

// What every plait failure raises: a DistBackendError carrying plait's kind, which the module's
// exception translator turns into the matching plait.torch error class in Python.
class Error : public c10::DistBackendError {
 public:
  Error(uint32_t kind, const std::string& msg, std::string group = "");
  uint32_t kind() const { return kind_; }
  // The group that raised it: Python attaches that group's flight report (e.flight) from it.
  const std::string& group() const { return group_; }

 private:
  uint32_t kind_;
  std::string group_;
};

class Backend;

// An Op's CUDA side: the stream its plait calls were enqueued on, and the event recorded there
// after them (and after the op's steps, which torch enqueues on the same stream).
struct GpuOp {
  explicit GpuOp(c10::Stream s) : stream(s) {}
  c10::Stream stream;
  std::unique_ptr<c10::Event> event;  // recorded by launch()
};

// The current stream of CUDA device `d` (torch's, device-generic: no CUDA headers needed).
c10::Stream current_stream(c10::Device d);

class Op {
 public:
  Op(Backend* b, std::string what, std::vector<at::Tensor> value);
  void issue(uint8_t coll, const plait_buffer* in, const plait_buffer* out, uint8_t op, int root,
             int peer, int64_t tag);
  // Holds t until the calls finish; a CUDA tensor is also recorded on its device's current
  // stream, so torch's caching allocator does not hand its memory out before the call ran there.
  void keep(const at::Tensor& t);
  void after(std::function<void()> f) { after_.push_back(std::move(f)); }
  void after_first(std::function<void()> f) { after_.insert(after_.begin(), std::move(f)); }
  // Called once every plait call is issued: returns the Work (complete already when sync).
  c10::intrusive_ptr<c10d::Work> launch();
  std::string where() const;  // "plait allreduce on group 'x' (rank r of n)", for errors

  // For Work.
  bool done() const { return state_.load(std::memory_order_acquire) != 0; }
  // done(), starting the calls if not: a caller that polls may not wait soon. A GPU op: whether
  // its stream has got past the calls (the event), without blocking.
  bool poll();
  bool gpu() const { return gpu_ != nullptr; }
  void block_current_stream();  // GPU op: the device's current stream waits for the calls
  // GPU op, wait() given a timeout: as c10d's NCCL Work, the host waits for the stream to get
  // past the calls, up to `timeout` (then a timeout error; the calls go on).
  void wait_gpu(std::chrono::milliseconds timeout);
  // Has plait's progress thread start calls left to a waiter (capi.h's task_start).
  void start();
  bool ok() const { return state_.load(std::memory_order_acquire) == 1; }
  std::exception_ptr error() const { return error_; }
  bool wait(std::chrono::milliseconds timeout);
  c10::intrusive_ptr<c10::ivalue::Future> future();
  const std::vector<at::Tensor>& value() const { return value_; }
  int source() const;  // the sender of a finished recv (any-source: the one it matched)

  // The end of one plait call (ctx is a heap std::shared_ptr<Op>).
  static void on_call_done(void* ctx, uint32_t kind, const char* msg);
  void complete();  // runs the steps and completes the future, on whichever thread finished

  // Holds the op open until release(): a coalesced allreduce waits for its fused call.
  void hold() { outstanding_.fetch_add(1, std::memory_order_acq_rel); }
  void release(uint32_t kind, const char* msg) { finish_call(kind, msg); }
  void follow(std::shared_ptr<Op> op) { followers_.push_back(std::move(op)); }

  bool sync = false;              // the caller waits right away: plait calls run inline
  bool waiter_completes = false;  // launch() waits for the calls and completes the op itself
  double timeout_s = 0;           // per-call deadline (0: the communicator's)

 private:
  void finish_call(uint32_t kind, const char* msg);
  // gpu.cc: a call on CUDA buffers, enqueued on the current stream; the launch of such an op.
  void issue_gpu(uint8_t coll, const plait_buffer* in, const plait_buffer* out, uint8_t op,
                 int root, int peer, int64_t tag);
  c10::intrusive_ptr<c10d::Work> launch_gpu();
  c10::intrusive_ptr<c10::ivalue::Future> gpu_future();
  bool complete_unless_future();  // completes here unless a Future was handed out
  void run_steps();               // the after() steps, once

  Backend* b_;
  std::string what_;
  std::vector<at::Tensor> value_, keep_;
  std::vector<std::function<void()>> after_;
  std::vector<void*> tasks_;                    // plait task handles of async calls, in issue order
  std::vector<std::shared_ptr<Op>> followers_;  // ops released when this one completes
  std::shared_ptr<Op>* self_ = nullptr;
  std::atomic<int> outstanding_{1};  // async calls in flight, +1 until launch()
  std::atomic<int> state_{0};        // 0 pending, 1 ok, 2 failed
  bool ran_steps_ = false;           // run_steps ran
  uint32_t kind_ = 0;
  std::string msg_;
  std::exception_ptr error_;
  std::mutex mu_;
  std::condition_variable cv_;
  c10::intrusive_ptr<c10::ivalue::Future> fut_;
  std::unique_ptr<GpuOp> gpu_;  // set by the first call on CUDA buffers
  friend class Backend;
  friend class Work;

 public:
  std::weak_ptr<Op> weak;  // set by Backend::begin
  ~Op();
};

class Work : public c10d::Work {
 public:
  Work(std::shared_ptr<Op> op, c10d::OpType type);
  bool isCompleted() override { return op_->poll(); }
  bool isSuccess() const override { return op_->ok(); }
  std::exception_ptr exception() const override { return op_->error(); }
  std::vector<at::Tensor> result() override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return op_->future(); }
  void synchronize() override {
    if (op_->gpu()) op_->block_current_stream();
  }
  int sourceRank() const override { return op_->source(); }

 private:
  std::shared_ptr<Op> op_;
};

// One process group's plait backend over one communicator (owned by a Python object that
// `owner` keeps alive).
class Backend : public c10d::Backend {
 public:
  Backend(const plait_capi* api, void* comm, void* owner, int rank, int size, double timeout_s);
  ~Backend() override;

  const std::string getBackendName() const override { return "plait"; }
  void setTimeout(std::chrono::milliseconds t) override { timeout_s_ = double(t.count()) / 1000.0; }
  void shutdown() override;
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }
  // Communication buffers in plait shared memory (FSDP2 asks through
  // set_allocate_memory_from_process_group_for_comm): peers map them, so collectives on them
  // skip the kernel copies.
  bool supportsTensorAlloc(c10::DeviceIndex) override { return true; }
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override {
    return c10::make_intrusive<c10d::Backend::Options>(
        "plait", std::chrono::milliseconds(int64_t(timeout_s_ * 1000)));
  }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;
  void abort() override { shutdown(); }

  using Tensors = std::vector<at::Tensor>;
  using TensorLists = std::vector<std::vector<at::Tensor>>;
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  WorkPtr broadcast(Tensors& ts, const c10d::BroadcastOptions& o) override;
  WorkPtr allreduce(Tensors& ts, const c10d::AllreduceOptions& o) override;
  WorkPtr allreduce_coalesced(Tensors& ts, const c10d::AllreduceCoalescedOptions& o) override;
  WorkPtr reduce(Tensors& ts, const c10d::ReduceOptions& o) override;
  WorkPtr allgather(TensorLists& outs, Tensors& ins, const c10d::AllgatherOptions& o) override;
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override;
  WorkPtr allgather_coalesced(TensorLists& outs, Tensors& ins,
                              const c10d::AllgatherOptions& o) override;
  WorkPtr allgather_into_tensor_coalesced(Tensors& outs, Tensors& ins,
                                          const c10d::AllgatherOptions& o) override;
  WorkPtr gather(TensorLists& outs, Tensors& ins, const c10d::GatherOptions& o) override;
  WorkPtr scatter(Tensors& outs, TensorLists& ins, const c10d::ScatterOptions& o) override;
  WorkPtr reduce_scatter(Tensors& outs, TensorLists& ins,
                         const c10d::ReduceScatterOptions& o) override;
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override;
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outs, Tensors& ins,
                                          const c10d::ReduceScatterOptions& o) override;
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override;
  WorkPtr alltoall(Tensors& outs, Tensors& ins, const c10d::AllToAllOptions& o) override;
  WorkPtr send(Tensors& ts, int dst, int tag) override;
  WorkPtr recv(Tensors& ts, int src, int tag) override;
  WorkPtr recvAnysource(Tensors& ts, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& o) override;
  // gloo's monitored barrier (torch >= 2.14 sends dist.monitored_barrier to any CPU backend): a
  // blocking barrier under the options' timeout whose error names every rank that has not
  // arrived (plait's barrier always lists them all, so wait_all_ranks changes nothing).
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override;
  c10::intrusive_ptr<c10d::Backend> split(
      const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
      const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;

  // For Op.
  const plait_capi* api() const { return api_; }
  void* comm() const { return comm_; }
  double timeout_s() const { return timeout_s_; }
  Error error(uint32_t kind, const std::string& where, const std::string& msg) const;
  std::string label(const std::string& what) const;
  void post(std::shared_ptr<Op> op);  // completes op on the completion thread
  bool on_completion_thread() const;
  // gpu.cc: gives the communicator its GPU queue at the group's first CUDA tensor (every rank
  // creates it in that call, through plait._gpu, as plait's own first GPU call does), and
  // refuses a later tensor on another GPU on every rank.
  void ensure_gpu(const Op& op, uint8_t coll, int device);
  // At shutdown: drains and closes the GPU queue first, as plait's Communicator.finalize does.
  void finalize_gpu();
  [[noreturn]] void unsupported(const Op& op, const std::string& msg) const;
  [[noreturn]] void fail(const std::string& msg);  // aborts every rank; InvalidArgument here

 private:
  // Starts one torch call. sync: the caller waits at once (asyncOp false); timeout: the
  // options' (unset: the group's).
  std::shared_ptr<Op> begin(const std::string& what, Tensors value, bool sync,
                            std::chrono::milliseconds timeout = c10d::kUnsetTimeout,
                            bool fusable = false);
  // The checks every single-tensor call makes: one tensor per process, on the CPU or a CUDA
  // device; input and output on one device (else every rank raises, as plait's own calls do).
  void one_tensor(const Op& op, size_t n) const {
    if (n != 1) unsupported(op, "one tensor per process (got " + std::to_string(n) + ")");
  }
  void on_device(const Op& op, const at::Tensor& t) const {
    if (!t.is_cpu() && !t.is_cuda())
      unsupported(op, "tensor on " + t.device().str() + " (plait takes CPU and CUDA tensors)");
  }
  void same_device(const Op& op, const at::Tensor& in, const at::Tensor& out);
  void one_device(const Op& op, const Tensors& a, const Tensors& b = {});  // all of a and b
  struct Red;
  Red red_of(const c10d::ReduceOp& r, const Op& op) const;
  void reduce_into(Op& op, at::Tensor x, at::Tensor y, const Red& red, int root, bool scatter);
  void reduce_by_gather(Op& op, const at::Tensor& x, at::Tensor y, const Red& red, int root,
                        bool scatter);
  void reduce_scatter_one(Op& op, at::Tensor out, const at::Tensor& in, const Red& red);
  void allgather_one(Op& op, at::Tensor out, const at::Tensor& in);
  void broadcast_one(Op& op, at::Tensor t, int root);
  void exchange(Op& op, const Tensors& srcs, const Tensors& dsts);
  at::Tensor sink(Op& op, const at::Tensor& t);
  void completion_loop();
  WorkPtr allreduce_sparse_coo(Tensors& ts, const c10d::AllreduceOptions& o);
  void check_sparse_shapes(const Op& op, const at::Tensor& table) const;
  void check_splits(const Op& op, const at::Tensor& src, const std::vector<int64_t>& in_rows,
                    const at::Tensor& dst, const std::vector<int64_t>& out_rows);

  const plait_capi* api_;
  void* comm_;
  void* owner_;  // PyObject*: the Python communicator
  double timeout_s_;
  std::string label_;
  std::mutex q_mu_;
  std::condition_variable q_cv_;
  std::deque<std::shared_ptr<Op>> queue_;
  bool stop_ = false;
  std::thread thread_;
  std::atomic<bool> closed_{false};
  bool coalescing_ = false;
  std::vector<std::shared_ptr<Op>> coalesced_;  // ops issued since startCoalescing
  // Coalesced allreduces of one dtype and op not issued yet: one fused call at the next other
  // op or at endCoalescing (flush).
  std::vector<std::pair<std::shared_ptr<Op>, at::Tensor>> fuse_;
  uint8_t fuse_op_ = 0;
  void flush();
  std::mutex gpu_mu_;
  std::atomic<int> gpu_device_{-1};  // the GPU of the communicator's GPU queue, once it has one
};

// The Work of a coalesced group of ops (endCoalescing): done when all of them are.
class GroupWork : public c10d::Work {
 public:
  explicit GroupWork(std::vector<std::shared_ptr<Op>> ops);
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  void synchronize() override {}

 private:
  std::vector<std::shared_ptr<Op>> ops_;
  c10::intrusive_ptr<c10::ivalue::Future> fut_;  // an empty group's
};

// Moves t's storage into plait shared memory in place (see the module's share_storage).
bool share_storage(const at::Tensor& t, const plait_capi* api);

}  // namespace plait_torch
