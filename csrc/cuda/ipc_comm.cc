#include "cuda/ipc_comm.h"

#include <cstdint>
#include <mutex>

namespace plait {
namespace {

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw PlaitError(what + ": " + cudaGetErrorString(e));
}

// How long the destructor of a communicator nobody finalized waits for peers to finish reading
// its staging before it frees it (finalize() waits the full deadline).
constexpr double kTeardownWaitS = 5;

}  // namespace

IpcComm::IpcComm(int rank, int size, int device, size_t staging_bytes, const GpuOptions& opt,
                 GpuPeers peers)
    : rank_(rank), size_(size), device_(device), opt_(opt), peers_(std::move(peers)) {
  if (staging_bytes < 4096)
    throw InvalidArgument("PLAIT_GPU_IPC_BYTES must be >= 4096, got " +
                          std::to_string(staging_bytes));
  DeviceGuard g(device_);
  tp_ = std::make_unique<IpcTransport>(rank, size, device, staging_bytes);
  cuda_ok(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), who() + ": cudaEventCreate");
  Watchdog::Hooks h = cuda_event_hooks(device_);
  h.poll = [this](ErrorKind* k) {
    const std::string e = kernel_error();
    if (!e.empty()) {
      *k = tp_->error() == IpcTransport::timed_out ? ErrorKind::timeout : ErrorKind::generic;
      return e;
    }
    return peers_.why_stuck(k);
  };
  h.abort = [this](ErrorKind k, const std::string& m) {
    record(k, who() + ": " + m + "; communicator aborted");
  };
  wd_ = std::make_unique<Watchdog>(std::move(h), gpu_watchdog_interval_s());
}

IpcComm::~IpcComm() {
  DeviceGuard g(device_);
  wd_.reset();  // its hooks use this communicator
  if (last_ && tp_ && !failed_ && !finalized_ && epoch_ > 0) {
    // Nobody finalized: peers may still read this rank's staging of the last epoch. Wait a
    // little for them (kernels give up on their own deadline) before freeing it under them.
    const double t0 = gpu_now_s();
    while (cudaEventQuery(last_) == cudaErrorNotReady && gpu_now_s() - t0 < kTeardownWaitS)
      gpu_pause(gpu_now_s() - t0);
    cudaStream_t s = nullptr;
    if (cudaEventQuery(last_) == cudaSuccess &&
        cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
      tp_->wait(IpcTransport::kDone, epoch_, IpcTransport::clamp_timeout_ns(kTeardownWaitS), s);
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }
  if (tp_) tp_->abort();  // a kernel of ours still waiting gives up instead of hanging the free
  if (last_) {
    cudaEventSynchronize(last_);
    cudaEventDestroy(last_);
  }
  tp_.reset();  // frees and unmaps with this GPU current, before the guard restores the caller's
}

std::string IpcComm::who() {
  std::lock_guard<std::mutex> lock(mu_);
  return "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device_) +
         ", CUDA IPC): " + cur_;
}

void IpcComm::open(const std::vector<std::string>& handles) {
  DeviceGuard g(device_);
  tp_->open(handles);
}

void IpcComm::throw_if_failed() {
  if (!failed_) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw_error(first_kind_, "GPU communicator aborted after an earlier error: " + first_error_);
}

void IpcComm::record(ErrorKind kind, const std::string& msg) {
  tp_->abort();
  {
    // The watchdog, a waiting thread (torch's completion thread) and the issuing thread may all
    // get here; the first error is the one every later call reports.
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) return;
    first_error_ = msg;
    first_kind_ = kind;
    failed_ = true;
  }
  peers_.tell(kind, msg);
}

void IpcComm::fail(ErrorKind kind, const std::string& msg) {
  record(kind, msg);
  throw_error(kind, msg);
}

std::string IpcComm::kernel_error() {
  switch (tp_->error()) {
    case IpcTransport::ok:
      return "";
    case IpcTransport::timed_out:
      return "a peer did not reach the same step within the deadline (the waiting kernel gave up)";
    case IpcTransport::peer_gave_up:
      return "a peer gave up on this call (its flag carries the poison: it timed out or was "
             "aborted)";
    default:
      return "the GPU work was aborted";
  }
}

void IpcComm::check_done() {
  throw_if_failed();  // a kernel that gave up on the host's abort: the host's error is the cause
  const std::string e = kernel_error();
  if (e.empty()) return;
  fail(tp_->error() == IpcTransport::timed_out ? ErrorKind::timeout : ErrorKind::generic,
       who() + ": " + e + "; communicator aborted");
}

void IpcComm::poll_pending(double deadline) {
  throw_if_failed();
  ErrorKind kind = ErrorKind::generic;
  std::string why = peers_.why_stuck(&kind);
  if (why.empty() && gpu_now_s() > deadline)
    kind = ErrorKind::timeout, why = "did not finish within its deadline";
  if (!why.empty()) fail(kind, who() + ": " + why + "; communicator aborted");
}

void IpcComm::call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op,
                   const std::string& algo, cudaStream_t stream, double timeout_s, int root,
                   int peer) {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  throw_if_failed();
  if (peers_.throw_if_aborted) peers_.throw_if_aborted();
  if (tp_->error() != IpcTransport::ok) check_done();
  const Algorithm* alg = nullptr;
  DeviceGuard g(device_);
  try {
    validate_gpu_call(c, in, out, op, root, peer, rank_, size_, device_);
    alg = algorithms_for(c, kIpcCaps)[size_t(algorithm_index(c, kIpcCaps, resolve(c, algo)))];
  } catch (const InvalidArgument& e) {
    fail(ErrorKind::invalid, e.what());
  }
  try {
    refuse_capture(
        stream,
        "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device_) + ", CUDA IPC)", c);
  } catch (const InvalidArgument& e) {
    record(ErrorKind::invalid, e.what());  // peers learn of it; nothing was enqueued
    throw;
  }
  CallArgs a = gpu_call_args(c, in, out, op, root, peer);
  a.timeout_s = timeout_s >= 0 ? timeout_s : opt_.timeout_s;  // 0 is a deadline that has passed
  const std::string what = std::string(coll_name(c)) + " (" + alg->name + ", " +
                           dtype_name(a.dtype) + ", count " + std::to_string(a.count) + ")";
  {
    std::lock_guard<std::mutex> lock(mu_);
    cur_ = what;
  }
  try {
    Watchdog::Event start = wd_->acquire(), end = wd_->acquire();
    cuda_ok(cudaStreamWaitEvent(stream, last_, 0), who() + ": cudaStreamWaitEvent");
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(start), stream), who() + ": cudaEventRecord");
    IpcCtx ctx{*tp_,  a,     stream, dtype_size(a.dtype),
               rank_, size_, epoch_, IpcTransport::clamp_timeout_ns(a.timeout_s)};
    alg->run.on_ipc(ctx);
    cuda_ok(cudaEventRecord(last_, stream), who() + ": cudaEventRecord");
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(end), stream), who() + ": cudaEventRecord");
    wd_->track(start, end, a.timeout_s, what);
  } catch (const PlaitError& e) {
    if (!failed_) fail(e.kind(), e.what());
    throw;
  }
}

void IpcComm::finalize() {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  if (failed_ || finalized_) return;
  DeviceGuard g(device_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    cur_ = "finalize";
  }
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who() + ": cudaStreamCreate");
  cuda_ok(cudaStreamWaitEvent(s, last_, 0), who() + ": cudaStreamWaitEvent");
  // Peers may still be reading this rank's staging of the last epoch: free it only after.
  if (epoch_ > 0)
    tp_->wait(IpcTransport::kDone, epoch_, IpcTransport::clamp_timeout_ns(opt_.timeout_s), s);
  cuda_ok(cudaEventRecord(last_, s), who() + ": cudaEventRecord");
  const double deadline = gpu_now_s() + opt_.timeout_s, t0 = gpu_now_s();
  while (cudaEventQuery(last_) == cudaErrorNotReady) {
    poll_pending(deadline);
    gpu_pause(gpu_now_s() - t0);
  }
  cudaStreamDestroy(s);
  check_done();
  finalized_ = true;
}

}  // namespace plait
