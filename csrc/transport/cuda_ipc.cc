#include "transport/cuda_ipc.h"

#include "cuda/stream_queue.h"  // gpu_now_s, gpu_pause

namespace plait {
namespace {
// How long the destructor of a queue nobody finalized waits for peers to finish reading this
// rank's staging before it frees it (finalize() waits the full deadline).
constexpr double kTeardownWaitS = 5;
}  // namespace

CudaIpcTransport::CudaIpcTransport(int rank, int size, int device, size_t staging_bytes)
    : rank_(rank), size_(size), device_(device) {
  if (staging_bytes < 4096)
    throw InvalidArgument("PLAIT_GPU_IPC_BYTES must be >= 4096, got " +
                          std::to_string(staging_bytes));
  DeviceGuard g(device);
  tp_ = std::make_unique<IpcMapping>(rank, size, device, staging_bytes);
}

std::string CudaIpcTransport::async_error(ErrorKind* kind) {
  switch (tp_->error()) {
    case IpcMapping::ok:
      return "";
    case IpcMapping::timed_out:
      *kind = ErrorKind::timeout;
      return "a peer did not reach the same step within the deadline (the waiting kernel gave up)";
    case IpcMapping::peer_gave_up:
      *kind = ErrorKind::generic;
      return "a peer gave up on this call (its flag carries the poison: it timed out or was "
             "aborted)";
    default:
      *kind = ErrorKind::generic;
      return "the GPU work was aborted";
  }
}

CudaIpcTransport::~CudaIpcTransport() {
  DeviceGuard g(device_);  // frees and unmaps on this rank's GPU, whoever drops the transport
  tp_.reset();
}

void CudaIpcTransport::drain(cudaStream_t s, double timeout_s) {
  // Peers may still be reading this rank's staging of the last epoch: free it only after.
  if (epoch_ > 0) tp_->wait(IpcMapping::kDone, epoch_, IpcMapping::clamp_timeout_ns(timeout_s), s);
}

void CudaIpcTransport::teardown(cudaEvent_t last) {
  if (epoch_ == 0) return;
  // Nobody finalized: peers may still read this rank's staging of the last epoch. Wait a little
  // for them (kernels give up on their own deadline) before it is freed under them.
  const double t0 = gpu_now_s();
  while (cudaEventQuery(last) == cudaErrorNotReady && gpu_now_s() - t0 < kTeardownWaitS)
    gpu_pause(gpu_now_s() - t0);
  cudaStream_t s = nullptr;
  if (cudaEventQuery(last) == cudaSuccess &&
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess) {
    tp_->wait(IpcMapping::kDone, epoch_, IpcMapping::clamp_timeout_ns(kTeardownWaitS), s);
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
}

}  // namespace plait
