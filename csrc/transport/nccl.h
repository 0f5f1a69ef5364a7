// The NCCL transport: one non-blocking NCCL communicator (so every host wait has a deadline),
// NCCL's collectives and send/recv for the algorithms (GpuOps), and a scratch area of two chunks
// for plait's own GPU algorithms. One GPU per rank, any number of hosts. CUDA builds only.
#pragma once
#include <string>

#include "cuda/nccl_loader.h"
#include "transport/device.h"

namespace plait {

// NCCL as plait's GPU algorithms use it (GpuCtx), on the stream of the call being enqueued:
// every operation is checked and throws with the call named.
class GpuOps {
 public:
  virtual ~GpuOps() = default;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  virtual void send(const void* buf, size_t bytes, int peer) = 0;
  virtual void recv(void* buf, size_t bytes, int peer) = 0;
  virtual void all_reduce(const void* in, void* out, size_t count, nccl::DataType t,
                          nccl::RedOp op) = 0;
  virtual void reduce_scatter(const void* in, void* out, size_t count, nccl::DataType t,
                              nccl::RedOp op) = 0;
  virtual void all_gather(const void* in, void* out, size_t bytes) = 0;
  virtual void broadcast(const void* in, void* out, size_t bytes, int root) = 0;
  virtual void reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op,
                      int root) = 0;
};

class NcclTransport final : public DeviceTransport, public GpuOps {
 public:
  // chunk_bytes: PLAIT_GPU_CHUNK_BYTES (>= 64); not measured on a GPU yet.
  NcclTransport(const NcclApi& api, const nccl::UniqueId& id, int rank, int size, int device,
                int64_t chunk_bytes);
  ~NcclTransport() override;

  const char* name() const override { return "nccl"; }
  std::string describe() const override;
  Caps caps() const override { return kNcclCaps; }
  bool launches_elsewhere() const override { return true; }
  void connect(const Poll& poll) override;
  // Around one call's steps: the stream they go on, the call's name for messages, its poll.
  void begin(cudaStream_t s, const std::string& what, const Poll& poll);
  void end();
  char* scratch() const { return scratch_; }  // two chunks
  int64_t chunk_bytes() const { return chunk_bytes_; }
  std::string async_error(ErrorKind* kind) override;
  void abort() override;
  void close(const Poll& poll) override;

  // GpuOps, for the algorithms: each call is checked, and throws with the call named.
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

  const NcclApi& api_;
  nccl::UniqueId id_;
  nccl::Comm comm_ = nullptr;
  int rank_, size_, device_;
  int64_t chunk_bytes_;
  char* scratch_ = nullptr;
  // The call being enqueued (run): for the algorithms' NCCL calls and their messages.
  cudaStream_t stream_ = nullptr;
  const std::string* what_ = nullptr;
  const Poll* poll_ = nullptr;
  // ncclGroupStart calls not yet closed on this (the issuing) thread: an error inside a group
  // must close it before ncclCommAbort runs, which NCCL otherwise defers into the open group.
  int group_open_ = 0;
};

}  // namespace plait
