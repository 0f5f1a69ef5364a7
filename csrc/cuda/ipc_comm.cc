#include "cuda/ipc_comm.h"

#include <cstdint>
#include <mutex>

namespace plait {
namespace {

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw PlaitError(what + ": " + cudaGetErrorString(e));
}

// Seconds (>= 0, possibly inf: no deadline) as the GPU-side waits' nanoseconds, saturating: a
// double past 2^64 converted to uint64_t is undefined.
uint64_t timeout_ns(double s) { return s < 1.8e10 ? uint64_t(s * 1e9) : UINT64_MAX; }

}  // namespace

IpcComm::IpcComm(int rank, int size, int device, size_t staging_bytes, const GpuOptions& opt, GpuPeers peers)
    : rank_(rank), size_(size), device_(device), opt_(opt), peers_(std::move(peers)) {
  if (staging_bytes < 4096) throw InvalidArgument("PLAIT_GPU_IPC_BYTES must be >= 4096, got " + std::to_string(staging_bytes));
  DeviceGuard g(device_);
  tp_ = std::make_unique<IpcTransport>(rank, size, device, staging_bytes);
  cuda_ok(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), who() + ": cudaEventCreate");
}

IpcComm::~IpcComm() {
  DeviceGuard g(device_);
  if (tp_) tp_->abort();  // a kernel of ours still waiting gives up instead of hanging the free
  if (last_) {
    cudaEventSynchronize(last_);
    cudaEventDestroy(last_);
  }
  tp_.reset();  // frees and unmaps with this GPU current, before the guard restores the caller's
}

std::string IpcComm::who() {
  std::lock_guard<std::mutex> lock(mu_);
  return "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device_) + ", CUDA IPC): " + cur_;
}

void IpcComm::open(const std::vector<std::string>& handles) {
  DeviceGuard g(device_);
  tp_->open(handles);
}

void IpcComm::throw_if_failed() {
  if (!failed_) return;
  std::lock_guard<std::mutex> lock(mu_);
  throw PlaitError("GPU communicator aborted after an earlier error: " + first_error_);
}

void IpcComm::fail(ErrorKind kind, const std::string& msg) {
  tp_->abort();
  {
    // A waiting thread (torch's completion thread) and the issuing thread may both get here.
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) first_error_ = msg;
    failed_ = true;
  }
  peers_.tell_and_throw(kind, msg);
}

void IpcComm::check_done() {
  switch (tp_->error()) {
    case IpcTransport::ok: return;
    case IpcTransport::timed_out:
      fail(ErrorKind::timeout, who() + ": a peer did not reach the same step within the deadline "
                               "(the waiting kernel gave up); communicator aborted");
    default:
      fail(ErrorKind::generic, who() + ": the GPU work was aborted");
  }
}

void IpcComm::poll_pending(double deadline) {
  throw_if_failed();
  if (peers_.throw_if_aborted) {
    try {
      peers_.throw_if_aborted();
    } catch (const PlaitError& e) {
      fail(e.kind(), who() + ": given up: another rank aborted the communicator: " + e.what());
    }
  }
  if (gpu_now_s() > deadline)
    fail(ErrorKind::timeout, who() + ": did not finish within its deadline; communicator aborted");
}

void IpcComm::call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, const std::string& algo,
                   cudaStream_t stream, double timeout_s, int root, int peer) {
  throw_if_failed();
  if (peers_.throw_if_aborted) peers_.throw_if_aborted();
  if (tp_->error() != IpcTransport::ok) check_done();
  const IpcAlgorithm* alg = nullptr;
  try {
    validate_gpu_call(c, in, out, op, root, peer, rank_, size_, device_);
    std::string names;
    for (const IpcAlgorithm& a : ipc_algorithm_table()) {
      if (a.coll != c) continue;
      if (!alg && (algo.empty() || algo == "auto" || algo == a.name)) alg = &a;  // auto: the first
      names += std::string(names.empty() ? "" : ", ") + a.name;
    }
    if (names.empty())
      throw InvalidArgument("rank " + std::to_string(rank_) + ": " + coll_name(c) +
                            " of GPU arrays has no path over the CUDA IPC transport (ranks sharing a GPU) in this "
                            "version: it runs over NCCL, with one GPU per rank; IPC has allreduce, reduce_scatter "
                            "and allgather");
    if (!alg)
      throw InvalidArgument("rank " + std::to_string(rank_) + ": " + coll_name(c) + ": no algorithm '" + algo +
                            "' over the CUDA IPC transport (" + (names.empty() ? "none" : names) +
                            "; the others run over NCCL, with one GPU per rank)");
  } catch (const InvalidArgument& e) {
    fail(ErrorKind::invalid, e.what());
  }
  DeviceGuard g(device_);
  CallArgs a = gpu_call_args(c, in, out, op, root, peer);
  a.timeout_s = timeout_s >= 0 ? timeout_s : opt_.timeout_s;  // 0 is a deadline that has passed
  {
    std::lock_guard<std::mutex> lock(mu_);
    cur_ = std::string(coll_name(c)) + " (" + alg->name + ", " + dtype_name(a.dtype) + ", count " + std::to_string(a.count) + ")";
  }
  try {
    cuda_ok(cudaStreamWaitEvent(stream, last_, 0), who() + ": cudaStreamWaitEvent");
    IpcCtx ctx{*tp_, a, stream, dtype_size(a.dtype), rank_, size_, epoch_, timeout_ns(a.timeout_s)};
    alg->run(ctx);
    cuda_ok(cudaEventRecord(last_, stream), who() + ": cudaEventRecord");
  } catch (const PlaitError& e) {
    if (!failed_) fail(e.kind(), e.what());
    throw;
  }
}

void IpcComm::finalize() {
  if (failed_) return;
  DeviceGuard g(device_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    cur_ = "finalize";
  }
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who() + ": cudaStreamCreate");
  cuda_ok(cudaStreamWaitEvent(s, last_, 0), who() + ": cudaStreamWaitEvent");
  // Peers may still be reading this rank's staging of the last epoch: free it only after.
  if (epoch_ > 0) tp_->wait(IpcTransport::kDone, epoch_, timeout_ns(opt_.timeout_s), s);
  cuda_ok(cudaEventRecord(last_, s), who() + ": cudaEventRecord");
  const double deadline = gpu_now_s() + opt_.timeout_s, t0 = gpu_now_s();
  while (cudaEventQuery(last_) == cudaErrorNotReady) {
    poll_pending(deadline);
    gpu_pause(gpu_now_s() - t0);
  }
  cudaStreamDestroy(s);
  check_done();
}

}  // namespace plait
