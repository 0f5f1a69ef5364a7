// A GPU transport's queue as the communicator drives it: calls on GPU buffers take the same path
// as host calls (validate -> select -> check -> run), and only the run differs: it is enqueued on
// the caller's CUDA stream by the queue of the transport that connects the ranks (NCCL, or CUDA
// IPC between ranks of one host), not executed by the host.
//
// The queue is device code's only seam into the communicator: this header has no CUDA types, so
// the communicator, the call path and a test queue (FakeDeviceQueue: records calls, runs nothing)
// build and run in every build; the CUDA queue (cuda/stream_queue.h) is compiled with CUDA only.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "algo/algo.h"
#include "core/call.h"
#include "core/errors.h"
#include "core/watchdog.h"  // GpuPeers

namespace plait {

// The row `algo` ("auto", "", or a name) runs as for collective c over a GPU transport offering
// `caps` (select_algorithm, with PLAIT_GPU_ALGO over NCCL; IPC rows go by name or auto); throws
// InvalidArgument naming the choices. Every rank resolves alike, so a setting that differs
// between ranks is caught by the call check (the algorithm is in the fingerprint).
const Algorithm& resolve_device_algo(Coll c, const std::string& algo, Caps caps,
                                     const AlgoOverride& ov, int rank);

class DeviceQueue {
 public:
  // The communicator's check of a call against the other ranks, given the resolved algorithm.
  using Check = std::function<void(const CallArgs&, const char* algo)>;

  DeviceQueue(int rank, int size, int device, double timeout_s, const std::string& algo_override)
      : rank_(rank),
        size_(size),
        device_(device),
        timeout_s_(timeout_s),
        ov_(algo_override, kNcclCaps, /*strict=*/false, "PLAIT_GPU_ALGO") {}
  virtual ~DeviceQueue() = default;
  DeviceQueue(const DeviceQueue&) = delete;
  DeviceQueue& operator=(const DeviceQueue&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  double default_timeout() const { return timeout_s_; }
  virtual const char* transport() const = 0;  // "nccl", "ipc" (transport_table's names)
  virtual Caps caps() const = 0;

  // The GPU call path, once for every transport: validate (validate_call), select
  // (resolve_device_algo), check (the communicator's fingerprint; none for a queue that stands
  // alone), enqueue. timeout_s < 0: the queue's default. Bad input aborts the call on every rank.
  void call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
            const std::string& algo, double timeout_s, const Check& check);
  const char* resolve(Coll c, const std::string& algo) const {
    return resolve_device_algo(c, algo, caps(), ov_, rank_).name;
  }
  // Waits (deadline) for everything enqueued, then closes the transport.
  virtual void finalize() = 0;

 protected:
  // Throws the queue's first error again (an earlier call's, the watchdog's, a peer's).
  virtual void throw_if_failed() = 0;
  // Records the error for every rank, ends the queue's work in flight, and throws it.
  [[noreturn]] virtual void fail(ErrorKind kind, const std::string& msg) = 0;
  // Enqueues one validated, checked call on `stream`.
  virtual void enqueue(const Algorithm& alg, const CallArgs& a, uintptr_t stream) = 0;

  const int rank_, size_, device_;
  const double timeout_s_;
  const AlgoOverride ov_;  // PLAIT_GPU_ALGO (applies over NCCL)

 private:
  std::mutex issue_mu_;  // one call at a time: checked in the order it is enqueued
};

// The order of what CPU tests of the GPU path see happen: each FakeDeviceQueue record takes the
// next number, and a test's stand-in for CUDA events (the native torch backend's fake CUDA device)
// numbers its records from the same counter, so a test reads "enqueued, then the event recorded".
std::atomic<uint64_t>& fake_gpu_clock();

// A queue that runs nothing and records what it was handed (coll, algorithm, count, stream, the
// buffers' addresses, dtype, op, root, peer), for CPU tests of the GPU call path; it offers the
// capabilities of the transport it stands in for.
class FakeDeviceQueue final : public DeviceQueue {
 public:
  struct Record {
    std::string coll, algo;
    int64_t count;
    uintptr_t stream;
    uintptr_t in, out;  // the buffers' device addresses (0: none)
    DType dtype;
    RedOp op;
    int root, peer;
    uint64_t seq;  // fake_gpu_clock() when it was enqueued
  };
  FakeDeviceQueue(int rank, int size, int device, const std::string& transport, double timeout_s,
                  const std::string& algo_override, GpuPeers peers);
  const char* transport() const override { return transport_.c_str(); }
  Caps caps() const override { return caps_; }
  void finalize() override {}
  std::vector<Record> records();

 protected:
  void throw_if_failed() override;
  [[noreturn]] void fail(ErrorKind kind, const std::string& msg) override;
  void enqueue(const Algorithm& alg, const CallArgs& a, uintptr_t stream) override;

 private:
  std::string transport_;
  Caps caps_;
  GpuPeers peers_;
  std::mutex mu_;
  std::vector<Record> records_;
  bool failed_ = false;
  ErrorKind first_kind_ = ErrorKind::none;
  std::string first_error_;
};

}  // namespace plait
