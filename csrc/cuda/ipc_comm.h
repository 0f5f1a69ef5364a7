// The GPU communicator over the CUDA IPC transport (ranks of one host, several per GPU allowed):
// validates a call, runs an IPC algorithm on the caller's stream. Waits have two guards: the
// waiting kernels give up on their own deadline, and the host raises the abort word when the
// call's deadline passes or another rank aborted the CPU communicator; either way every rank
// raises and the communicator is dead afterwards. A watchdog thread (core/watchdog.h) follows
// every call in flight, waited on or not: it raises the abort word on the deadline, a peer's
// abort or death, and reads the error word once a kernel gave up, recording the error for every
// rank. One thread issues at a time (call_mu_).
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/gpu_comm.h"
#include "cuda/ipc.h"

namespace plait {

class IpcComm final : public GpuWork {
 public:
  IpcComm(int rank, int size, int device, size_t staging_bytes, const GpuOptions& opt,
          GpuPeers peers);
  ~IpcComm() override;

  std::string handle() const { return tp_->handle(); }
  void open(const std::vector<std::string>& handles);
  void call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, const std::string& algo,
            cudaStream_t stream, double timeout_s, int root = 0,
            int peer = -1);  // timeout_s < 0: default
  // Waits (deadline) until every peer has read this rank's staging for the last time.
  void finalize();

  int device() const override { return device_; }
  double default_timeout() const override { return opt_.timeout_s; }
  void poll_pending(double deadline) override;
  void check_done() override;
  const char* resolve(Coll c, const std::string& algo) const {
    return resolve_ipc_algo(c, algo, rank_);
  }

 private:
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg);
  void record(ErrorKind kind,
              const std::string& msg);  // any thread: abort word, first error, peers
  std::string kernel_error();  // what a kernel that gave up reported, as a message ("" if none)
  void throw_if_failed();
  std::string who();  // rank, GPU and the call in progress

  int rank_, size_, device_;
  GpuOptions opt_;
  GpuPeers peers_;
  std::unique_ptr<IpcTransport> tp_;
  uint64_t epoch_ = 0;
  cudaEvent_t last_ = nullptr;
  std::mutex call_mu_;  // the issuing thread: epoch_, the transport's flags and streams
  std::mutex mu_;       // first_error_ and cur_: a waiting thread reads them
  std::atomic<bool> failed_{false};
  bool finalized_ = false;
  std::string first_error_;
  ErrorKind first_kind_ = ErrorKind::generic;  // raised again by every later call
  std::string cur_ = "idle";
  std::unique_ptr<Watchdog> wd_;
};

}  // namespace plait
