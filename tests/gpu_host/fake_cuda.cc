// The fake CUDA runtime (fake_cuda.h): cudart's entry points over host threads and memory.
#include "fake_cuda.h"

#include <time.h>

#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace fake {
namespace {

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

std::atomic<int> g_hangs{0};

// Waits until pred() or kHangS passed (then counts a hang and returns false).
template <class P>
bool spin_until(P pred) {
  const double t0 = now_s();
  for (int i = 0; !pred(); ++i) {
    if (now_s() - t0 > kHangS) {
      ++g_hangs;
      return false;
    }
    if (i > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return true;
}

class Stream {
 public:
  Stream() : worker_([this] { loop(); }) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  void push(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(f));
      ++pushed_;
    }
    cv_.notify_all();
  }
  void sync() {
    uint64_t target;
    {
      std::lock_guard<std::mutex> l(mu_);
      target = pushed_;
    }
    spin_until([&] { return done_.load() >= target; });
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stopping, and everything ran
      std::function<void()> f = std::move(q_.front());
      q_.pop_front();
      l.unlock();
      f();
      ++done_;
      l.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> q_;
  uint64_t pushed_ = 0;
  std::atomic<uint64_t> done_{0};
  bool stop_ = false;
  std::thread worker_;
};

struct Event {
  std::atomic<uint64_t> recorded{0}, reached{0};  // generations
};

Stream& legacy() {
  static Stream* s = new Stream;  // never destroyed: work may still be queued at exit
  return *s;
}

Stream& stream_of(cudaStream_t s) {
  if (s == nullptr || s == cudaStreamLegacy) return legacy();
  if (s == cudaStreamPerThread) {
    thread_local std::unique_ptr<Stream> mine(new Stream);
    return *mine;
  }
  return *reinterpret_cast<Stream*>(s);
}

Event* ev(cudaEvent_t e) { return reinterpret_cast<Event*>(e); }

std::mutex g_mu;
std::vector<std::pair<cudaStream_t, cudaEvent_t>> g_waits;
std::atomic<int> g_fail_mallocs{0};
// The one capture this fake models: which stream, in which mode, by which thread.
cudaStream_t g_capturing = nullptr;
std::thread::id g_capturer;
cudaStreamCaptureMode g_capture_mode = cudaStreamCaptureModeGlobal;
bool g_invalidated = false;
thread_local cudaStreamCaptureMode tl_mode = cudaStreamCaptureModeGlobal;
thread_local cudaError_t tl_last = cudaSuccess;
thread_local int tl_device = 0;

cudaError_t fail(cudaError_t e) {
  tl_last = e;
  return e;
}

// CUDA's rule for "unsafe" calls (cudaEventQuery, cudaStreamSynchronize, ...) during a capture.
bool refused_by_capture() {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_capturing || g_invalidated) return false;
  const bool same_thread = g_capturer == std::this_thread::get_id();
  const bool prohibited = tl_mode == cudaStreamCaptureModeGlobal
                              ? (g_capture_mode == cudaStreamCaptureModeGlobal || same_thread)
                              : tl_mode == cudaStreamCaptureModeThreadLocal && same_thread;
  if (!prohibited) return false;
  g_invalidated = true;
  ++counters().capture_refusals;
  return true;
}

}  // namespace

void launch(cudaStream_t s, std::function<void()> work) { stream_of(s).push(std::move(work)); }

void gate(cudaStream_t s, const std::atomic<bool>* g) {
  launch(s, [g] { spin_until([g] { return g->load(); }); });
}

int hangs() { return g_hangs.load(); }

Counters& counters() {
  static Counters c;
  return c;
}

std::vector<std::pair<cudaStream_t, cudaEvent_t>> stream_waits() {
  std::lock_guard<std::mutex> l(g_mu);
  return g_waits;
}

void clear_log() {
  std::lock_guard<std::mutex> l(g_mu);
  g_waits.clear();
}

void fail_mallocs(int n) { g_fail_mallocs = n; }

}  // namespace fake

using namespace fake;

extern "C" {

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorStreamCaptureUnsupported:
      return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
      return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    default:
      return "cudaErrorUnknown (fake)";
  }
}

const char* cudaGetErrorString(cudaError_t e) { return cudaGetErrorName(e); }

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = tl_last;
  tl_last = cudaSuccess;
  return e;
}

cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* d) {
  *d = tl_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) {
  tl_device = d;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  ++counters().mallocs;
  if (g_fail_mallocs > 0 && g_fail_mallocs-- > 0) return fail(cudaErrorMemoryAllocation);
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
  return *p ? cudaSuccess : fail(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* p) {
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind, cudaStream_t s) {
  launch(s, [=] { std::memmove(dst, src, n); });
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  *s = reinterpret_cast<cudaStream_t>(new Stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete reinterpret_cast<Stream*>(s);  // runs what is queued first, as CUDA does
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (refused_by_capture()) return fail(cudaErrorStreamCaptureUnsupported);
  stream_of(s).sync();
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  ++counters().events_created;
  *e = reinterpret_cast<cudaEvent_t>(new Event);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  // CUDA defers the release until recorded work completes; so does this fake (a leak in tests).
  (void)e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Event* x = ev(e);
  const uint64_t g = ++x->recorded;
  launch(s, [x, g] {
    uint64_t cur = x->reached.load();
    while (cur < g && !x->reached.compare_exchange_weak(cur, g)) {
    }
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  ++counters().event_queries;
  if (refused_by_capture()) return fail(cudaErrorStreamCaptureUnsupported);
  return ev(e)->reached.load() >= ev(e)->recorded.load() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  Event* x = ev(e);
  const uint64_t g = x->recorded.load();
  spin_until([&] { return x->reached.load() >= g; });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  {
    std::lock_guard<std::mutex> l(g_mu);
    g_waits.emplace_back(s, e);
  }
  Event* x = ev(e);
  const uint64_t g = x->recorded.load();
  launch(s, [x, g] { spin_until([&] { return x->reached.load() >= g; }); });
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
  std::lock_guard<std::mutex> l(g_mu);
  g_capturing = s;
  g_capturer = std::this_thread::get_id();
  g_capture_mode = mode;
  g_invalidated = false;
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
  std::lock_guard<std::mutex> l(g_mu);
  *graph = nullptr;
  const bool bad = g_invalidated;
  g_capturing = nullptr;
  g_invalidated = false;
  return bad ? fail(cudaErrorStreamCaptureInvalidated) : cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* st) {
  std::lock_guard<std::mutex> l(g_mu);
  *st = g_capturing && g_capturing == s
            ? (g_invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive)
            : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  const cudaStreamCaptureMode old = tl_mode;
  tl_mode = *mode;
  *mode = old;
  return cudaSuccess;
}

}  // extern "C"
