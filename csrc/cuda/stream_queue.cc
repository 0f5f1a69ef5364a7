#include "cuda/stream_queue.h"

#include <sched.h>
#include <time.h>

#include <cstdlib>

#include "algo/gpu_algo.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"

namespace plait {

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw PlaitError(what + ": " + cudaGetErrorString(e));
}

double gpu_watchdog_interval_s() {
  // 10 ms: a deadline is seconds, and a thread that wakes 100 times a second while calls are in
  // flight costs nothing measurable; PLAIT_GPU_WATCHDOG_MS tunes it (tests, debugging).
  const char* v = std::getenv("PLAIT_GPU_WATCHDOG_MS");
  const double ms = v && *v ? std::atof(v) : 10.0;
  return ms > 0 ? ms * 1e-3 : 10e-3;
}

double gpu_now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

void gpu_pause(double waited_s) {
  // Enqueue-time waits are short (NCCL connecting, a group settling): spin a little, then yield,
  // then sleep 100 us, so a rank that waits for a slow peer does not burn a core.
  if (waited_s < 1e-3) return;
  if (waited_s < 20e-3) {
    sched_yield();
    return;
  }
  timespec ts{0, 100000};
  nanosleep(&ts, nullptr);
}

DeviceGuard::DeviceGuard(int d) {
  if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
  if (prev != d) cudaSetDevice(d);
}

DeviceGuard::~DeviceGuard() {
  int cur = -1;
  if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
}

void refuse_capture(cudaStream_t stream, const std::string& who, Coll c) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(stream, &st);
  if (e == cudaSuccess && st == cudaStreamCaptureStatusNone) return;
  if (e != cudaSuccess) cudaGetLastError();
  throw InvalidArgument(
      who + ": " + coll_name(c) + ": the stream is being captured into a CUDA graph (" +
      (e != cudaSuccess ? cudaGetErrorString(e) : "cudaStreamIsCapturing") +
      "): plait's GPU collectives cannot be captured (torch.cuda.graph, torch.compile "
      "mode=\"reduce-overhead\")); the GPU communicator is aborted on every rank (the ranks "
      "may not all capture alike, so the call cannot simply be skipped): create a new "
      "communicator and issue its calls outside the capture");
}

bool is_capture_error(cudaError_t e) {
  switch (e) {
    case cudaErrorStreamCaptureUnsupported:
    case cudaErrorStreamCaptureInvalidated:
    case cudaErrorStreamCaptureMerge:
    case cudaErrorStreamCaptureUnmatched:
    case cudaErrorStreamCaptureUnjoined:
    case cudaErrorStreamCaptureIsolation:
    case cudaErrorStreamCaptureImplicit:
    case cudaErrorStreamCaptureWrongThread:
      return true;
    default:
      return false;
  }
}

Watchdog::Hooks cuda_event_hooks(int device) {
  Watchdog::Hooks h;
  h.create = [device] {
    DeviceGuard g(device);
    cudaEvent_t e = nullptr;
    cuda_ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return static_cast<Watchdog::Event>(e);
  };
  h.destroy = [device](Watchdog::Event e) {
    DeviceGuard g(device);
    cudaEventDestroy(static_cast<cudaEvent_t>(e));
  };
  h.query = [device](Watchdog::Event e, std::string* why) {
    DeviceGuard g(device);
    const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
    if (r == cudaSuccess) return 1;
    if (r == cudaErrorNotReady) return 0;
    cudaGetLastError();  // not this thread's to report to torch or cupy
    // Another thread's capture (torch.cuda.graph) refused the query: not a GPU failure, ask later.
    if (is_capture_error(r)) return 0;
    *why = cudaGetErrorName(r);
    return -1;
  };
  h.on_thread_start = [] {
    // The watchdog polls events while other threads may capture CUDA graphs in the default global
    // mode, which forbids cudaEventQuery from any thread and invalidates the capture; a thread in
    // ThreadLocal mode is outside that rule (torch's NCCL watchdog does the same).
    cudaStreamCaptureMode m = cudaStreamCaptureModeThreadLocal;
    cudaThreadExchangeStreamCaptureMode(&m);
  };
  return h;
}

std::string DeviceTransport::handle() const {
  throw InvalidArgument(std::string("the ") + name() + " transport has no memory handle");
}

void DeviceTransport::open(const std::vector<std::string>&) {
  throw InvalidArgument(std::string("the ") + name() + " transport maps no peer memory");
}

// ---------------------------------------------------------------------------------------------

StreamQueue::StreamQueue(std::unique_ptr<DeviceTransport> tp, int rank, int size, int device,
                         double timeout_s, const std::string& algo_override, GpuPeers peers)
    : DeviceQueue(rank, size, device, timeout_s, algo_override),
      tp_(std::move(tp)),
      peers_(std::move(peers)) {
  DeviceGuard g(device_);
  cuda_ok(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), who() + ": cudaEventCreate");
  try {
    std::lock_guard<std::mutex> lock(call_mu_);
    deadline_ = gpu_now_s() + timeout_s_;
    tp_->connect([this](const std::string& what) { poll_once(what); });
  } catch (const PlaitError& e) {
    if (!failed_) record(e.kind(), e.what());  // peers stop waiting in their own init
    tp_->abort();
    cudaEventDestroy(last_);  // no destructor runs for a constructor that throws
    throw;
  } catch (...) {
    tp_->signal_abort();
    tp_->abort();
    cudaEventDestroy(last_);
    throw;
  }
  Watchdog::Hooks h = cuda_event_hooks(device_);
  h.poll = [this](ErrorKind* k) { return watch_poll(k); };
  h.abort = [this](ErrorKind k, const std::string& m) {
    abort_async(k, who() + ": " + m + "; communicator aborted");
  };
  wd_ = std::make_unique<Watchdog>(std::move(h), gpu_watchdog_interval_s());
}

StreamQueue::~StreamQueue() {
  DeviceGuard g(device_);
  wd_.reset();  // its hooks use this queue
  std::lock_guard<std::mutex> lock(call_mu_);
  if (!failed_ && !finalized_) tp_->teardown(last_);
  // Never a hang: whatever is still in flight is aborted, not waited for (finalize() waits).
  tp_->signal_abort();
  tp_->abort();
  if (last_) {
    cudaEventSynchronize(last_);
    cudaEventDestroy(last_);
  }
  if (relay_) cudaStreamDestroy(relay_);
  if (handoff_) cudaEventDestroy(handoff_);
  tp_.reset();  // frees with this GPU current, before the guard restores the caller's
}

std::string StreamQueue::who() const {
  return "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device_) + ", " +
         tp_->describe() + ")";
}

void StreamQueue::open(const std::vector<std::string>& handles) {
  CallLock lock(this);
  DeviceGuard g(device_);
  tp_->open(handles);
}

void StreamQueue::throw_first() {
  std::lock_guard<std::mutex> lock(err_mu_);
  throw_error(first_kind_, "GPU communicator aborted after an earlier error: " + first_error_);
}

void StreamQueue::throw_if_failed() {
  if (failed_) throw_first();
  if (peers_.throw_if_aborted) peers_.throw_if_aborted();
}

void StreamQueue::throw_if_failed_locked() {
  if (!failed_) return;
  abort_pending_ = false;
  tp_->abort();  // the thread that recorded the error could not: this one held the transport
  throw_first();
}

void StreamQueue::record(ErrorKind kind, const std::string& msg) {
  tp_->signal_abort();
  {
    // The watchdog, a waiting thread (torch's completion thread) and the issuing thread may all
    // get here; the first error is the one every later call reports.
    std::lock_guard<std::mutex> lock(err_mu_);
    if (failed_) return;
    first_error_ = msg;
    first_kind_ = kind;
    failed_ = true;
  }
  peers_.tell(kind, msg);
}

void StreamQueue::fail_locked(ErrorKind kind, const std::string& msg) {
  record(kind, msg);
  tp_->abort();
  throw_error(kind, msg);
}

void StreamQueue::fail(ErrorKind kind, const std::string& msg) {
  CallLock lock(this);
  DeviceGuard g(device_);
  fail_locked(kind, msg);
}

void StreamQueue::abort_async(ErrorKind kind, const std::string& msg) {
  record(kind, msg);
  // Only when no thread is inside a transport call; else the thread that holds it ends it when it
  // lets go (CallLock), even if it never issues another call.
  abort_pending_ = true;
  CallLock lock(this, /*try_only=*/true);
}

StreamQueue::CallLock::CallLock(StreamQueue* q, bool try_only) : q_(q) {
  owns_ = try_only ? q_->call_mu_.try_lock() : (q_->call_mu_.lock(), true);
}

StreamQueue::CallLock::~CallLock() {
  if (!owns_) return;
  q_->call_mu_.unlock();
  q_->run_pending_abort();
}

void StreamQueue::run_pending_abort() {
  // Whoever held call_mu_ when abort_async asked sees abort_pending_ after letting go (the flag is
  // set before abort_async's try_lock); if another thread took the lock since, its release does it.
  while (abort_pending_) {
    std::unique_lock<std::mutex> lock(call_mu_, std::try_to_lock);
    if (!lock.owns_lock()) return;
    if (abort_pending_.exchange(false)) {
      DeviceGuard g(device_);
      tp_->abort();
    }
  }
}

std::string StreamQueue::watch_poll(ErrorKind* kind) {
  std::string why = peers_.why_stuck(kind);
  if (!why.empty()) return why;
  CallLock lock(this, /*try_only=*/true);
  if (!lock.owns()) return "";  // an issuing thread polls the transport itself
  return tp_->async_error(kind);
}

void StreamQueue::poll_once(const std::string& what) {
  throw_if_failed_locked();  // the watchdog may have recorded an error while this thread worked
  if (peers_.throw_if_aborted) {
    try {
      peers_.throw_if_aborted();
    } catch (const PlaitError& e) {
      fail_locked(e.kind(), who() + ": " + what +
                                " given up: another rank aborted the communicator: " + e.what());
    }
  }
  if (gpu_now_s() > deadline_) {
    std::string call;
    {
      std::lock_guard<std::mutex> lock(err_mu_);
      call = cur_;
    }
    fail_locked(ErrorKind::timeout, who() + ": " + call + ": " + what +
                                        " did not finish before its deadline; communicator "
                                        "aborted");
  }
}

void StreamQueue::enqueue(const Algorithm& alg, const CallArgs& a, uintptr_t stream_id) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_id);
  CallLock lock(this);
  DeviceGuard g(device_);
  throw_if_failed_locked();
  {
    ErrorKind k = ErrorKind::generic;
    const std::string e = tp_->async_error(&k);  // an earlier call's, found before the watchdog
    if (!e.empty()) fail_locked(k, who() + ": " + e + "; communicator aborted");
  }
  try {
    refuse_capture(stream, who(), a.coll);
  } catch (const InvalidArgument& e) {
    record(ErrorKind::invalid, e.what());  // no abort inside a capture: the next call does it
    throw;
  }
  const std::string what = std::string(coll_name(a.coll)) + " (" + alg.name + ", " +
                           dtype_name(a.dtype) + ", count " + std::to_string(a.count) + ")";
  {
    std::lock_guard<std::mutex> l(err_mu_);
    cur_ = what;
  }
  deadline_ = gpu_now_s() + a.timeout_s;  // 0 is a deadline that has passed
  try {
    Watchdog::Event start = wd_->acquire(), end = wd_->acquire();
    const cudaStream_t s = relay_for(stream);
    // Calls on different streams still run in issue order: transports require it, and they
    // share scratch and staging.
    cuda_ok(cudaStreamWaitEvent(s, last_, 0), who() + ": cudaStreamWaitEvent");
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(start), s), who() + ": cudaEventRecord");
    run(alg, a, what, s);
    cuda_ok(cudaEventRecord(last_, s), who() + ": cudaEventRecord");
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(end), s), who() + ": cudaEventRecord");
    if (s != stream)  // the caller's per-thread stream goes on once the relayed call ran
      cuda_ok(cudaStreamWaitEvent(stream, last_, 0), who() + ": cudaStreamWaitEvent");
    wd_->track(start, end, a.timeout_s, what);
    throw_if_failed_locked();  // the watchdog fired while this thread held the transport
  } catch (const PlaitError& e) {
    if (!failed_) fail_locked(e.kind(), e.what());
    throw;
  }
}

cudaStream_t StreamQueue::relay_for(cudaStream_t s) {
  // A non-blocking NCCL communicator launches from its own group-job thread, where the handle
  // cudaStreamPerThread means that thread's stream: the kernel would be ordered with neither the
  // caller's work nor plait's events. Such calls go on a stream of the queue's own, after the
  // caller's stream up to the call, and the caller's stream waits for them.
  if (s != cudaStreamPerThread || !tp_->launches_elsewhere()) return s;
  if (!relay_) {
    cuda_ok(cudaStreamCreateWithFlags(&relay_, cudaStreamNonBlocking),
            who() + ": cudaStreamCreate");
    cuda_ok(cudaEventCreateWithFlags(&handoff_, cudaEventDisableTiming),
            who() + ": cudaEventCreate");
  }
  cuda_ok(cudaEventRecord(handoff_, s), who() + ": cudaEventRecord");
  cuda_ok(cudaStreamWaitEvent(relay_, handoff_, 0), who() + ": cudaStreamWaitEvent");
  return relay_;
}

void StreamQueue::run(const Algorithm& alg, const CallArgs& a, const std::string& what,
                      cudaStream_t s) {
  // The view the row's runner takes, over this queue's transport (algo/gpu_algo.h).
  const size_t es = dtype_size(a.dtype);
  auto* nccl = dynamic_cast<NcclTransport*>(tp_.get());
  auto* ipc = dynamic_cast<CudaIpcTransport*>(tp_.get());
  if (alg.run.kind == Runner::gpu && nccl) {
    const DeviceTransport::Poll poll = [this](const std::string& w) { poll_once(w); };
    nccl->begin(s, what, poll);
    struct End {
      NcclTransport* t;
      ~End() { t->end(); }
    } end{nccl};
    GpuCtx ctx{*nccl,
               a,
               s,
               es,
               rank_,
               size_,
               std::max<int64_t>(1, nccl->chunk_bytes() / int64_t(es)),
               nccl->scratch()};
    alg.run.on_gpu(ctx);
  } else if (alg.run.kind == Runner::ipc && ipc) {
    IpcCtx ctx{ipc->mapping(),
               a,
               s,
               es,
               rank_,
               size_,
               ipc->epoch(),
               IpcMapping::clamp_timeout_ns(a.timeout_s)};
    alg.run.on_ipc(ctx);
  } else {
    throw PlaitError(who() + ": " + what + ": the row does not run over " + tp_->describe());
  }
}

void StreamQueue::finalize() {
  CallLock lock(this);
  if (failed_ || finalized_) return;
  DeviceGuard g(device_);
  {
    std::lock_guard<std::mutex> l(err_mu_);
    cur_ = "finalize";
  }
  deadline_ = gpu_now_s() + timeout_s_;
  const DeviceTransport::Poll poll = [this](const std::string& w) { poll_once(w); };
  cudaStream_t s = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), who() + ": cudaStreamCreate");
  try {
    cuda_ok(cudaStreamWaitEvent(s, last_, 0), who() + ": cudaStreamWaitEvent");
    tp_->drain(s, timeout_s_);
    cuda_ok(cudaEventRecord(last_, s), who() + ": cudaEventRecord");
    const double t0 = gpu_now_s();
    for (;;) {
      const cudaError_t e = cudaEventQuery(last_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady)
        fail_locked(ErrorKind::generic, who() + ": finalize: " + cudaGetErrorString(e));
      poll("finalize");
      ErrorKind k = ErrorKind::generic;
      const std::string err = tp_->async_error(&k);
      if (!err.empty()) fail_locked(k, who() + ": finalize: " + err + "; communicator aborted");
      gpu_pause(gpu_now_s() - t0);
    }
    ErrorKind k = ErrorKind::generic;
    const std::string err = tp_->async_error(&k);  // a kernel that gave up in the last call
    if (!err.empty()) fail_locked(k, who() + ": " + err + "; communicator aborted");
    tp_->close(poll);
  } catch (const PlaitError& e) {
    if (!failed_) record(e.kind(), e.what());  // a transport error: every rank learns of it
    tp_->abort();
    cudaStreamDestroy(s);
    throw;
  } catch (...) {
    cudaStreamDestroy(s);
    throw;
  }
  cudaStreamDestroy(s);
  finalized_ = true;
}

void StreamQueue::poll_pending(double deadline) {
  // Any thread: it touches the transport only through abort_async (the watchdog polls it).
  if (failed_) throw_first();
  ErrorKind kind = ErrorKind::generic;
  std::string why = peers_.why_stuck(&kind);
  if (why.empty() && gpu_now_s() > deadline) {
    kind = ErrorKind::timeout;
    why = "the GPU work waited for did not finish before its deadline";
  }
  if (why.empty()) return;
  why = who() + ": " + why + "; communicator aborted";
  abort_async(kind, why);
  throw_error(kind, why);
}

void StreamQueue::check_done() {
  if (failed_) throw_first();  // e.g. a kernel that gave up on the host's abort
  CallLock lock(this, /*try_only=*/true);
  if (!lock.owns()) return;  // the issuing thread checks before its next call
  ErrorKind k = ErrorKind::generic;
  const std::string e = tp_->async_error(&k);
  // The watchdog may have recorded an error meanwhile and left the abort to this thread.
  if (e.empty()) return throw_if_failed_locked();
  const std::string msg = who() + ": " + e + "; communicator aborted";
  record(k, msg);
  tp_->abort();
  throw_error(k, msg);
}

// ---------------------------------------------------------------------------------------------

GpuEvent::GpuEvent(std::shared_ptr<GpuWork> q, cudaStream_t s, double timeout_s)
    : q_(std::move(q)) {
  DeviceGuard g(q_->device());
  cuda_ok(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "cudaEventCreate");
  cuda_ok(cudaEventRecord(ev_, s), "cudaEventRecord");
  // A backstop only: the watchdog enforces the deadline from when the call started on the GPU
  // (work queued ahead of it on the stream does not count), and its error ends this wait.
  deadline_ = gpu_now_s() + 2 * (timeout_s >= 0 ? timeout_s : q_->default_timeout());
}

GpuEvent::~GpuEvent() {
  if (ev_) cudaEventDestroy(ev_);
}

bool GpuEvent::done() {
  DeviceGuard g(q_->device());
  return cudaEventQuery(ev_) == cudaSuccess;
}

void GpuEvent::block(cudaStream_t stream) {
  DeviceGuard g(q_->device());
  q_->poll_pending(deadline_ + 1e300);  // an error already recorded; no deadline here
  cuda_ok(cudaStreamWaitEvent(stream, ev_, 0), "cudaStreamWaitEvent");
}

bool GpuEvent::wait(double timeout_s) {
  DeviceGuard g(q_->device());
  const double t0 = gpu_now_s(), give_up = timeout_s < 0 ? 1e300 : t0 + timeout_s;
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) {
      q_->check_done();
      return true;
    }
    if (e != cudaErrorNotReady)
      throw PlaitError(std::string("GPU work failed: ") + cudaGetErrorString(e));
    q_->poll_pending(deadline_);
    if (gpu_now_s() > give_up) return false;
    gpu_pause(gpu_now_s() - t0);
  }
}

}  // namespace plait
