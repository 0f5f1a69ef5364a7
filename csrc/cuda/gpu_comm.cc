#include "cuda/gpu_comm.h"

#include <sched.h>
#include <time.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

namespace plait {
namespace {

double now_s() { return gpu_now_s(); }
void pause_briefly(double waited_s) { gpu_pause(waited_s); }

ErrorKind kind_of(nccl::Result r) {
  switch (r) {
    case nccl::RemoteError:
      return ErrorKind::peer_lost;
    case nccl::Timeout:
      return ErrorKind::timeout;
    case nccl::InvalidArgument:
    case nccl::InvalidUsage:
      return ErrorKind::invalid;
    default:
      return ErrorKind::generic;
  }
}

std::string version_text(int v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw PlaitError(what + ": " + cudaGetErrorString(e));
}

}  // namespace

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

GpuComm::GpuComm(const NcclApi& api, const nccl::UniqueId& id, int rank, int size, int device,
                 const GpuOptions& opt, GpuPeers peers)
    : api_(api),
      rank_(rank),
      size_(size),
      device_(device),
      opt_(opt),
      peers_(std::move(peers)),
      forced_(size_t(Coll::kCount)) {
  if (opt_.chunk_bytes < 64)
    throw InvalidArgument("PLAIT_GPU_CHUNK_BYTES must be >= 64, got " +
                          std::to_string(opt_.chunk_bytes));
  for (const std::string& item : [&] {
         std::vector<std::string> v;
         size_t at = 0;
         while (at <= opt_.algo_override.size() && !opt_.algo_override.empty()) {
           size_t comma = opt_.algo_override.find(',', at);
           v.push_back(opt_.algo_override.substr(
               at, comma == std::string::npos ? std::string::npos : comma - at));
           if (comma == std::string::npos) break;
           at = comma + 1;
         }
         return v;
       }()) {
    const size_t eq = item.find('=');
    for (int c = 0; c < int(Coll::kCount); ++c)
      if (eq == std::string::npos || item.substr(0, eq) == coll_name(Coll(c)))
        forced_[size_t(c)] = eq == std::string::npos ? item : item.substr(eq + 1);
  }
  DeviceGuard g(device_);
  try {
    cuda_ok(cudaEventCreateWithFlags(&last_, cudaEventDisableTiming), who() + ": cudaEventCreate");
    scratch_bytes_ = 2 * opt_.chunk_bytes;
    cuda_ok(cudaMalloc(reinterpret_cast<void**>(&scratch_), size_t(scratch_bytes_)),
            who() + ": cudaMalloc of " + std::to_string(scratch_bytes_) + " bytes of scratch");
    nccl::Config cfg{sizeof(nccl::Config), nccl::kApiMagic, nccl::kConfigVersion, 0,
                     nccl::kUndefInt,      nccl::kUndefInt, nccl::kUndefInt,      nullptr};
    deadline_ = now_s() + opt_.timeout_s;
    cur_.coll = Coll::barrier;
    cur_algo_ = "init";
    std::lock_guard<std::mutex> lock(call_mu_);
    check(api_.CommInitRankConfig(&comm_, size_, id, rank_, &cfg), "ncclCommInitRankConfig");
    Watchdog::Hooks h = cuda_event_hooks(device_);
    h.poll = [this](ErrorKind* k) { return watch_poll(k); };
    h.abort = [this](ErrorKind k, const std::string& m) {
      abort_async(k, who() + ": " + m + "; NCCL communicator aborted");
    };
    wd_ = std::make_unique<Watchdog>(std::move(h), gpu_watchdog_interval_s());
  } catch (...) {
    release();  // no destructor runs for a constructor that throws
    throw;
  }
}

GpuComm::~GpuComm() {
  DeviceGuard g(device_);
  release();
}

void GpuComm::release() {
  wd_.reset();  // its hooks use this communicator
  // Never a hang: whatever is still in flight is aborted, not waited for (finalize() waits).
  std::lock_guard<std::mutex> lock(call_mu_);
  if (comm_) api_.CommAbort(comm_);
  comm_ = nullptr;
  if (scratch_) cudaFree(scratch_);
  scratch_ = nullptr;
  if (last_) cudaEventDestroy(last_);
  last_ = nullptr;
}

std::string GpuComm::who() const {
  return "rank " + std::to_string(rank_) + " (GPU " + std::to_string(device_) + ", NCCL " +
         version_text(api_.version) + ")";
}

void GpuComm::abort_nccl() {
  if (comm_) api_.CommAbort(comm_);  // ends the NCCL kernels of every call in flight
  comm_ = nullptr;
}

void GpuComm::throw_if_failed() {
  if (!failed_) return;
  abort_nccl();  // the watchdog could not: this thread held the communicator
  std::lock_guard<std::mutex> lock(abort_mu_);
  throw_error(first_kind_, "GPU communicator aborted after an earlier error: " + first_error_);
}

void GpuComm::record(ErrorKind kind, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (failed_) return;
    first_error_ = msg;
    first_kind_ = kind;
    failed_ = true;
  }
  peers_.tell(kind, msg);
}

void GpuComm::fail(ErrorKind kind, const std::string& msg) {
  record(kind, msg);
  abort_nccl();
  throw_error(kind, msg);
}

void GpuComm::abort_async(ErrorKind kind, const std::string& msg) {
  record(kind, msg);
  // Only when no thread is inside an NCCL call on it; else that thread aborts at its next poll.
  std::unique_lock<std::mutex> lock(call_mu_, std::try_to_lock);
  if (lock.owns_lock()) abort_nccl();
}

std::string GpuComm::watch_poll(ErrorKind* kind) {
  std::string why = peers_.why_stuck(kind);
  if (!why.empty()) return why;
  std::unique_lock<std::mutex> lock(call_mu_, std::try_to_lock);
  if (!lock.owns_lock() || !comm_) return "";  // an issuing thread polls NCCL itself
  nccl::Result st = nccl::Success;
  if (api_.CommGetAsyncError(comm_, &st) != nccl::Success || st == nccl::Success ||
      st == nccl::InProgress)
    return "";
  const char* last = api_.GetLastError(comm_);
  *kind = kind_of(st);
  return std::string("NCCL reported an error for work in flight: ") + api_.GetErrorString(st) +
         (last && *last ? std::string(" (") + last + ")" : std::string());
}

void GpuComm::poll_once(const std::string& what) { poll_once(what, deadline_); }

void GpuComm::poll_once(const std::string& what, double deadline) {
  throw_if_failed();  // the watchdog may have recorded an error while this thread held comm_
  if (peers_.throw_if_aborted) {
    try {
      peers_.throw_if_aborted();
    } catch (const PlaitError& e) {
      fail(e.kind(),
           who() + ": " + what + " given up: another rank aborted the communicator: " + e.what());
    }
  }
  if (now_s() > deadline)
    fail(ErrorKind::timeout, who() + ": " + coll_name(cur_.coll) + " (" + cur_algo_ + ", " +
                                 dtype_name(cur_.dtype) + ", count " + std::to_string(cur_.count) +
                                 "): " + what +
                                 " did not finish before its deadline; NCCL communicator aborted");
}

nccl::Result GpuComm::settle(const std::string& what) {
  const double t0 = now_s();
  for (;;) {
    nccl::Result st = nccl::Success;
    const nccl::Result r = api_.CommGetAsyncError(comm_, &st);
    if (r != nccl::Success) return r;
    if (st != nccl::InProgress) return st;
    poll_once(what);
    pause_briefly(now_s() - t0);
  }
}

void GpuComm::check(nccl::Result r, const std::string& what) {
  if (r == nccl::InProgress) r = settle(what);
  if (r == nccl::Success) return;
  const char* last = comm_ ? api_.GetLastError(comm_) : nullptr;
  fail(kind_of(r), who() + ": " + coll_name(cur_.coll) + " (" + cur_algo_ + ", " +
                       dtype_name(cur_.dtype) + ", count " + std::to_string(cur_.count) +
                       "): " + what + " failed: " + api_.GetErrorString(r) +
                       (last && *last ? std::string(" (") + last + ")" : std::string()) +
                       "; NCCL communicator aborted");
}

void GpuComm::group_start() { check(api_.GroupStart(), "ncclGroupStart"); }
void GpuComm::group_end() { check(api_.GroupEnd(), "ncclGroupEnd"); }

void GpuComm::send(const void* buf, size_t bytes, int peer) {
  check(api_.Send(buf, bytes, nccl::Uint8, peer, comm_, stream_),
        "ncclSend of " + std::to_string(bytes) + " bytes to rank " + std::to_string(peer));
}

void GpuComm::recv(void* buf, size_t bytes, int peer) {
  check(api_.Recv(buf, bytes, nccl::Uint8, peer, comm_, stream_),
        "ncclRecv of " + std::to_string(bytes) + " bytes from rank " + std::to_string(peer));
}

void GpuComm::all_reduce(const void* in, void* out, size_t count, nccl::DataType t,
                         nccl::RedOp op) {
  check(api_.AllReduce(in, out, count, t, op, comm_, stream_), "ncclAllReduce");
}

void GpuComm::reduce_scatter(const void* in, void* out, size_t count, nccl::DataType t,
                             nccl::RedOp op) {
  check(api_.ReduceScatter(in, out, count, t, op, comm_, stream_), "ncclReduceScatter");
}

void GpuComm::all_gather(const void* in, void* out, size_t bytes) {
  check(api_.AllGather(in, out, bytes, nccl::Uint8, comm_, stream_), "ncclAllGather");
}

void GpuComm::broadcast(const void* in, void* out, size_t bytes, int root) {
  check(api_.Broadcast(in, out, bytes, nccl::Uint8, root, comm_, stream_),
        "ncclBroadcast from rank " + std::to_string(root));
}

void GpuComm::reduce(const void* in, void* out, size_t count, nccl::DataType t, nccl::RedOp op,
                     int root) {
  check(api_.Reduce(in, out, count, t, op, root, comm_, stream_),
        "ncclReduce to rank " + std::to_string(root));
}

const char* resolve_gpu_algo(Coll c, const std::string& algo,
                             const std::vector<std::string>& forced,
                             const std::string& override_text, int rank) {
  const std::string& want = algo == "auto" || algo.empty() ? forced[size_t(c)] : algo;
  const auto& algos = algorithms_for(c, kNcclCaps);
  std::string names;
  for (const Algorithm* a : algos) {
    if (want == a->name) return a->name;
    names += std::string(names.empty() ? "" : ", ") + a->name;
  }
  // PLAIT_GPU_ALGO=ring forces ring where there is one; collectives without it keep auto.
  const bool blanket =
      (algo == "auto" || algo.empty()) && override_text.find('=') == std::string::npos;
  if (!algos.empty() && (want.empty() || blanket)) {
    const int i = algorithm_index(c, kNcclCaps, auto_algorithm(c, {kNcclCaps}));
    if (i >= 0) return algos[size_t(i)]->name;
  }
  throw InvalidArgument("rank " + std::to_string(rank) + ": " + coll_name(c) +
                        ": no GPU algorithm '" + want + "' (" +
                        (names.empty() ? "this collective has no GPU path yet" : names) + ")");
}

const char* resolve_ipc_algo(Coll c, const std::string& algo, int rank) {
  const auto& algos = algorithms_for(c, kIpcCaps);
  if (algos.empty())
    throw InvalidArgument(
        "rank " + std::to_string(rank) + ": " + coll_name(c) +
        " of GPU arrays has no path over the CUDA IPC transport (ranks sharing a GPU) in this "
        "version: it runs over NCCL, with one GPU per rank; IPC has allreduce, reduce_scatter "
        "and allgather");
  const std::string want =
      algo.empty() || algo == "auto" ? auto_algorithm(c, {kIpcCaps}) : std::string(algo);
  std::string names;
  for (const Algorithm* a : algos) {
    if (want == a->name) return a->name;
    names += std::string(names.empty() ? "" : ", ") + a->name;
  }
  throw InvalidArgument("rank " + std::to_string(rank) + ": " + coll_name(c) + ": no algorithm '" +
                        algo + "' over the CUDA IPC transport (" + names +
                        "; the others run over NCCL, with one GPU per rank)");
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
      "mode=\"reduce-overhead\"); issue them outside the capture");
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
  h.query = [device](Watchdog::Event e) {
    DeviceGuard g(device);
    const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(e));
    return r == cudaSuccess ? 1 : r == cudaErrorNotReady ? 0 : -1;
  };
  return h;
}

void validate_gpu_call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root,
                       int peer, int rank_, int size_, int device_) {
  const std::string head =
      "rank " + std::to_string(rank_) + ": " + coll_name(c) + " on GPU " + std::to_string(device_);
  const bool p2p = c == Coll::send || c == Coll::recv;
  if ((c == Coll::broadcast || c == Coll::reduce) && (root < 0 || root >= size_))
    throw InvalidArgument(head + ": root " + std::to_string(root) + " is outside a world of " +
                          std::to_string(size_));
  if (p2p && (peer < 0 || peer >= size_ || peer == rank_))
    throw InvalidArgument(head + ": peer " + std::to_string(peer) +
                          " is not another rank of a world of " + std::to_string(size_));
  const bool need_in = c != Coll::recv,
             need_out = c != Coll::send && !(c == Coll::reduce && rank_ != root);
  if ((need_in && !in.present) || (need_out && !out.present))
    throw InvalidArgument(head + ": needs " +
                          (need_in && need_out ? "an input and an output"
                           : need_in           ? "an input"
                                               : "an output"));
  const GpuBuffer& any = in.present ? in : out;
  const size_t es = dtype_size(any.dtype);
  const std::string what = " (" + std::string(dtype_name(any.dtype)) + ", input " +
                           std::to_string(in.bytes / es) + " elements, output " +
                           std::to_string(out.bytes / es) + ")";
  if (in.present && out.present && in.dtype != out.dtype)
    throw InvalidArgument(head + ": input is " + dtype_name(in.dtype) + ", output " +
                          dtype_name(out.dtype));
  if ((in.present && in.device != device_) || (out.present && out.device != device_))
    throw InvalidArgument(head + ": input on GPU " + std::to_string(in.device) +
                          ", output on GPU " + std::to_string(out.device) +
                          "; this communicator's GPU work runs on GPU " + std::to_string(device_));
  if (op == RedOp::avg && !is_float(any.dtype))
    throw InvalidArgument(head + ": avg needs a floating-point dtype" + what);
  if (p2p)
    return;  // one buffer: the peer's must match it (NCCL cannot check; a mismatch ends at the
             // deadline)
  if (c == Coll::reduce && !out.present) return;
  const size_t n = size_t(size_);
  const bool ok = c == Coll::reduce_scatter ? in.bytes == n * out.bytes
                  : c == Coll::allgather    ? out.bytes == n * in.bytes
                  : c == Coll::alltoall     ? in.bytes == out.bytes && in.bytes % (n * es) == 0
                                        : in.bytes == out.bytes;  // allreduce, broadcast, reduce
  if (!ok)
    throw InvalidArgument(head + ": sizes do not fit a world of " + std::to_string(size_) + what);
  // In place is out == in (allreduce, broadcast, reduce), out = this rank's block of in
  // (reduce_scatter), in = this rank's block of out (allgather); alltoall has none. Any other
  // overlap would be read after it was written.
  const char *ib = static_cast<const char*>(in.ptr), *ob = static_cast<const char*>(out.ptr);
  const bool overlap = ib < ob + out.bytes && ob < ib + in.bytes && in.bytes && out.bytes;
  const bool in_place = c == Coll::reduce_scatter ? ob == ib + size_t(rank_) * out.bytes
                        : c == Coll::allgather    ? ib == ob + size_t(rank_) * in.bytes
                        : c == Coll::alltoall     ? false
                                                  : ib == ob;
  if (overlap && !in_place)
    throw InvalidArgument(
        head + ": input and output overlap" +
        (c == Coll::alltoall ? " (alltoall cannot run in place)" : " other than in place") + what);
}

CallArgs gpu_call_args(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op, int root,
                       int peer) {
  CallArgs a;
  a.coll = c;
  a.dtype = in.present ? in.dtype : out.dtype;
  a.op = op;
  a.root = root;
  a.peer = peer;
  a.in = in.ptr;
  a.out = out.present ? out.ptr : nullptr;
  const bool by_input = c == Coll::allgather || c == Coll::reduce || c == Coll::send;
  a.count = int64_t((by_input ? in.bytes : out.bytes) / dtype_size(a.dtype));
  return a;
}

void GpuComm::call(Coll c, const GpuBuffer& in, const GpuBuffer& out, RedOp op,
                   const std::string& algo, cudaStream_t stream, double timeout_s, int root,
                   int peer) {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  throw_if_failed();
  if (peers_.throw_if_aborted) peers_.throw_if_aborted();
  const Algorithm* alg = nullptr;
  DeviceGuard g(device_);
  try {
    validate_gpu_call(c, in, out, op, root, peer, rank_, size_, device_);
    const char* name = resolve(c, algo);
    alg = algorithms_for(c, kNcclCaps)[size_t(algorithm_index(c, kNcclCaps, name))];
  } catch (const InvalidArgument& e) {
    // Bad input aborts the call on every rank, as on the CPU path; no peer waits on GPU work
    // this rank will never enqueue.
    fail(ErrorKind::invalid, e.what());
  }
  try {
    refuse_capture(stream, who(), c);
  } catch (const InvalidArgument& e) {
    record(ErrorKind::invalid, e.what());  // no abort inside a capture: the next call does it
    throw;
  }
  cur_ = gpu_call_args(c, in, out, op, root, peer);
  cur_.timeout_s = timeout_s >= 0 ? timeout_s : opt_.timeout_s;  // 0 is a deadline that has passed
  cur_algo_ = alg->name;
  stream_ = stream;
  deadline_ = now_s() + cur_.timeout_s;
  // Calls on different streams still run in issue order: NCCL requires it, and they share scratch.
  cuda_ok(cudaStreamWaitEvent(stream, last_, 0), who() + ": cudaStreamWaitEvent");
  const size_t es = dtype_size(cur_.dtype);
  GpuCtx ctx{
      *this,   cur_, stream, es, rank_, size_, std::max<int64_t>(1, opt_.chunk_bytes / int64_t(es)),
      scratch_};
  try {
    Watchdog::Event start = wd_->acquire(), end = wd_->acquire();
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(start), stream), who() + ": cudaEventRecord");
    alg->run.on_gpu(ctx);
    cuda_ok(cudaEventRecord(last_, stream), who() + ": cudaEventRecord");
    cuda_ok(cudaEventRecord(static_cast<cudaEvent_t>(end), stream), who() + ": cudaEventRecord");
    wd_->track(start, end, cur_.timeout_s,
               std::string(coll_name(c)) + " (" + cur_algo_ + ", " + dtype_name(cur_.dtype) +
                   ", count " + std::to_string(cur_.count) + ")");
    throw_if_failed();  // the watchdog fired while this thread held the communicator
  } catch (const PlaitError& e) {
    if (!failed_) fail(e.kind(), e.what());
    throw;
  }
}

void GpuComm::finalize() {
  std::lock_guard<std::mutex> call_lock(call_mu_);
  if (!comm_ || failed_) return;
  DeviceGuard g(device_);
  deadline_ = now_s() + opt_.timeout_s;
  cur_algo_ = "finalize";
  const double t0 = now_s();
  for (;;) {
    const cudaError_t e = cudaEventQuery(last_);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady)
      fail(ErrorKind::generic, who() + ": finalize: " + cudaGetErrorString(e));
    check(settle("finalize"), "finalize");
    poll_once("finalize");
    pause_briefly(now_s() - t0);
  }
  nccl::Comm c = comm_;
  comm_ = nullptr;
  api_.CommDestroy(c);
}

void GpuComm::poll_pending(double deadline) {
  // Any thread: it never touches comm_ but through abort_async (the watchdog polls NCCL).
  if (failed_) {
    std::lock_guard<std::mutex> lock(abort_mu_);
    throw_error(first_kind_, "GPU communicator aborted after an earlier error: " + first_error_);
  }
  ErrorKind kind = ErrorKind::generic;
  std::string why = peers_.why_stuck(&kind);
  if (why.empty() && now_s() > deadline) {
    kind = ErrorKind::timeout;
    why = "the GPU work waited for did not finish before its deadline";
  }
  if (why.empty()) return;
  why = who() + ": " + why + "; NCCL communicator aborted";
  abort_async(kind, why);
  throw_error(kind, why);
}

GpuEvent::GpuEvent(std::shared_ptr<GpuWork> comm, cudaStream_t s, double timeout_s)
    : comm_(std::move(comm)) {
  DeviceGuard g(comm_->device());
  cuda_ok(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming), "cudaEventCreate");
  cuda_ok(cudaEventRecord(ev_, s), "cudaEventRecord");
  // A backstop only: the watchdog enforces the deadline from when the call started on the GPU
  // (work queued ahead of it on the stream does not count), and its error ends this wait.
  deadline_ = now_s() + 2 * (timeout_s >= 0 ? timeout_s : comm_->default_timeout());
}

GpuEvent::~GpuEvent() {
  if (ev_) cudaEventDestroy(ev_);
}

bool GpuEvent::done() {
  DeviceGuard g(comm_->device());
  return cudaEventQuery(ev_) == cudaSuccess;
}

void GpuEvent::block(cudaStream_t stream) {
  DeviceGuard g(comm_->device());
  comm_->poll_pending(deadline_ + 1e300);  // an error already recorded; no deadline here
  cuda_ok(cudaStreamWaitEvent(stream, ev_, 0), "cudaStreamWaitEvent");
}

bool GpuEvent::wait(double timeout_s) {
  DeviceGuard g(comm_->device());
  const double t0 = now_s(), give_up = timeout_s < 0 ? 1e300 : t0 + timeout_s;
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev_);
    if (e == cudaSuccess) {
      comm_->check_done();
      return true;
    }
    if (e != cudaErrorNotReady)
      throw PlaitError(std::string("GPU work failed: ") + cudaGetErrorString(e));
    comm_->poll_pending(deadline_);
    if (now_s() > give_up) return false;
    pause_briefly(now_s() - t0);
  }
}

}  // namespace plait
