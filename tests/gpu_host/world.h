// Ranks as threads for host tests of the GPU path: each rank builds its own StreamQueue over the
// fake NCCL or the fake CUDA IPC mapping, with GpuPeers over one shared abort record (what the
// CPU communicator is to a real job), and runs the test's body.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/stream_queue.h"
#include "fake_cuda.h"
#include "fake_nccl.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"

namespace host {

using namespace plait;

// A failed expectation: names the test's words and the line.
#define EXPECT(cond, ...)                                                    \
  do {                                                                       \
    if (!(cond)) {                                                           \
      std::fprintf(stderr, "FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "%s\n", host::words(__VA_ARGS__).c_str());        \
      std::exit(1);                                                          \
    }                                                                        \
  } while (0)

inline std::string words() { return ""; }
template <class A, class... R>
std::string words(const A& a, const R&... r) {
  std::string s;
  if constexpr (std::is_arithmetic<A>::value)
    s = std::to_string(a);
  else
    s = std::string(a);
  return s + " " + words(r...);
}

// The CPU communicator's part: the first error any rank recorded, raised by every rank.
struct Shared {
  std::mutex mu;
  std::atomic<bool> aborted{false};
  ErrorKind kind = ErrorKind::generic;
  std::string why;
  GpuPeers peers() {
    return GpuPeers{[this] {
                      if (!aborted) return;
                      std::lock_guard<std::mutex> l(mu);
                      throw_error(kind, why);
                    },
                    [this](ErrorKind k, const std::string& m) {
                      std::lock_guard<std::mutex> l(mu);
                      if (aborted) return;
                      kind = k, why = m;
                      aborted = true;
                    },
                    [] { return std::string(); }};
  }
};

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> l(mu_);
    const int gen = gen_;
    if (++count_ == n_) {
      count_ = 0, ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

struct Rank {
  int rank, size;
  std::shared_ptr<StreamQueue> q;
  cudaStream_t stream;  // this rank's own stream
  Shared* shared;
  Barrier* barrier;
};

enum class Tp { nccl, ipc };

// Runs body(rank) on n threads, each with its queue; returns each rank's error ("" if none).
std::vector<std::string> run_world(int n, Tp tp, const std::function<void(Rank&)>& body,
                                   int64_t chunk_bytes = 64, size_t staging = 4096,
                                   double timeout_s = 20);

Buffer dev(void* p, size_t bytes, DType t, cudaStream_t s);
// Enqueues a call, then waits for it as a GpuEvent does (raising the queue's error).
void call_and_wait(Rank& r, Coll c, const Buffer& in, const Buffer& out, RedOp op,
                   const std::string& algo, int root = 0, double timeout_s = -1);

}  // namespace host
