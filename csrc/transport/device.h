// What a GPU transport offers the stream queue (cuda/stream_queue.h) that drives it: connect,
// report and end work in flight, close. The algorithms' steps reach it through the view their
// row's runner takes (algo/gpu_algo.h: NCCL's operations, or the CUDA IPC mapping), which the
// queue builds; nothing here knows an algorithm. NCCL
// (transport/nccl.h) and CUDA IPC (transport/cuda_ipc.h) are the two; a third is one more class
// and one more slot in transport/table.cc. CUDA builds only.
//
// Locking: the queue calls every member with its issue lock held, except signal_abort(), which
// any thread may call at any time, and async_error(), which the watchdog calls only after taking
// the issue lock with try_lock.
#pragma once
#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <vector>

#include "core/call.h"
#include "core/errors.h"
#include "transport/table.h"

namespace plait {

class DeviceTransport {
 public:
  // Called while the host waits inside a transport call (NCCL connecting, a group settling):
  // throws the call's deadline, a peer's abort, or an error recorded meanwhile.
  using Poll = std::function<void(const std::string& what)>;

  virtual ~DeviceTransport() = default;
  virtual const char* name() const = 0;      // transport_table()'s name: "nccl", "ipc"
  virtual std::string describe() const = 0;  // for messages: "NCCL 2.27.3", "CUDA IPC"
  virtual Caps caps() const = 0;

  // True when the transport launches its work from a thread of its own (a non-blocking NCCL
  // communicator's group job): a stream handle that means "this thread's" (cudaStreamPerThread)
  // then names another stream there, so the queue hands such calls over through a real stream.
  virtual bool launches_elsewhere() const { return false; }
  // Joins the peers (NCCL: ncclCommInitRankConfig). Throws PlaitError.
  virtual void connect(const Poll& poll) { (void)poll; }
  // The handle peers map this rank's memory by, and mapping theirs (CUDA IPC only).
  virtual std::string handle() const;
  virtual void open(const std::vector<std::string>& handles);
  // An error the transport saw for work in flight ("" if none), and its kind.
  virtual std::string async_error(ErrorKind* kind) = 0;
  // Makes this rank's waiting device work give up (IPC: the abort word); any thread.
  virtual void signal_abort() {}
  // Ends all work in flight; the transport is unusable afterwards (NCCL: ncclCommAbort).
  virtual void abort() = 0;
  // finalize(), before the queue waits for its stream: enqueue on s whatever must run before
  // this rank's memory may be freed (IPC: every peer has read this rank's staging).
  virtual void drain(cudaStream_t s, double timeout_s) { (void)s, (void)timeout_s; }
  // finalize(), once everything enqueued has run (NCCL: ncclCommDestroy).
  virtual void close(const Poll& poll) { (void)poll; }
  // The destructor of a queue nobody finalized: `last` is its last call's end. A short grace for
  // peers still reading this rank's memory (IPC) before it is freed.
  virtual void teardown(cudaEvent_t last) { (void)last; }
};

}  // namespace plait
