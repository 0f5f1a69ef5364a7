// The CUDA IPC transport as the stream queue drives it: ranks of one host (several per GPU
// allowed, which NCCL refuses) exchange data through each other's device staging, mapped with
// cudaIpc handles (transport/cuda_ipc_mapping.h: the mapping, the flags and the waiting kernels).
// Calls count epochs over the transport's life; a waiting kernel gives up on its own deadline or
// the host's abort word, and reports why in an error word the host reads. CUDA builds only.
// Lifetime: a peer's finalize drain reads this rank's flags after this rank's own drain ended, so
// the transport (its memory) may be dropped only once every rank finished finalize; the host
// communicator's finalize has a barrier for it (plait._gpu.after_finalize). Found by the host
// tests under ThreadSanitizer (tests/test_gpu_host.py).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "transport/cuda_ipc_mapping.h"
#include "transport/device.h"

namespace plait {

class CudaIpcTransport final : public DeviceTransport {
 public:
  // staging_bytes: PLAIT_GPU_IPC_BYTES (>= 4096) of device memory per rank.
  CudaIpcTransport(int rank, int size, int device, size_t staging_bytes);
  ~CudaIpcTransport() override;

  const char* name() const override { return "ipc"; }
  std::string describe() const override { return "CUDA IPC"; }
  Caps caps() const override { return kIpcCaps; }
  std::string handle() const override { return tp_->handle(); }
  void open(const std::vector<std::string>& handles) override { tp_->open(handles); }
  IpcMapping& mapping() { return *tp_; }
  uint64_t& epoch() { return epoch_; }  // exchanges so far (IpcCtx::begin counts them)
  std::string async_error(ErrorKind* kind) override;
  void signal_abort() override { tp_->abort(); }
  void abort() override { tp_->abort(); }
  void drain(cudaStream_t s, double timeout_s) override;
  void teardown(cudaEvent_t last) override;

 private:
  int rank_, size_, device_;
  std::unique_ptr<IpcMapping> tp_;
  uint64_t epoch_ = 0;
};

}  // namespace plait
