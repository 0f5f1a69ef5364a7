// The second GPU review's findings 1-4 (reviews/gpu-review-2.md), each driven through the
// unchanged stream queue and NCCL transport over the fakes; each fails without its fix.
#include <chrono>

#include "world.h"

namespace host {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

// Finding 1: the watchdog queries events while another thread captures a CUDA graph in global
// mode: the queries must neither invalidate that capture nor be taken for a GPU failure.
void test_watchdog_leaves_captures_alone() {
  fake::nccl_reset_stats();
  const auto errors = run_world(1, Tp::nccl, [](Rank& r) {
    std::atomic<bool> open{false};
    std::vector<float> x(16, 1.0f);
    fake::gate(r.stream, &open);  // the call waits behind user work: in flight, watched
    r.q->call(Coll::allreduce, dev(x.data(), 64, DType::f32, r.stream),
              dev(x.data(), 64, DType::f32, r.stream), RedOp::sum, 0, -1, "nccl", 30, nullptr);
    cudaStream_t cap;
    cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking);
    const int refused = fake::counters().capture_refusals;
    const int queries = fake::counters().event_queries;
    EXPECT(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal) == cudaSuccess);
    sleep_ms(100);  // the watchdog polls every 1 ms
    cudaGraph_t g;
    const cudaError_t e = cudaStreamEndCapture(cap, &g);
    EXPECT(fake::counters().event_queries > queries + 5, "the watchdog queried meanwhile");
    EXPECT(fake::counters().capture_refusals == refused && e == cudaSuccess,
           "the watchdog's cudaEventQuery broke the user's capture:", cudaGetErrorName(e));
    open = true;
    GpuEvent ev(std::static_pointer_cast<GpuWork>(r.q), r.stream, 30);
    EXPECT(ev.wait(-1));  // raises if the watchdog took the refusal for a failure
    EXPECT(fake::nccl_stats().aborts == 0, "the watchdog aborted the communicator");
    cudaStreamDestroy(cap);
    r.q->finalize();
  });
  EXPECT(errors[0].empty(), errors[0]);
}

// Finding 2: an NCCL error inside ncclGroupStart/End must close the group before the abort runs,
// or NCCL only queues the abort and this thread's later NCCL calls vanish into the open group.
void test_error_inside_a_group_closes_it() {
  fake::nccl_reset_stats();
  std::atomic<int> depth_after{-1};
  const auto errors = run_world(2, Tp::nccl, [&](Rank& r) {
    std::vector<int32_t> x(64, r.rank + 1);
    if (r.rank == 0) fake::nccl_fail_send(0, 2);  // inside the second step's group
    try {
      call_and_wait(r, Coll::allreduce, dev(x.data(), 256, DType::i32, r.stream),
                    dev(x.data(), 256, DType::i32, r.stream), RedOp::sum, "ring", 0, 10);
    } catch (...) {
      if (r.rank == 0) depth_after = fake::nccl_group_depth();
      throw;
    }
  });
  EXPECT(errors[0].find("ncclSend of") != std::string::npos &&
             errors[0].find("remote process exited") != std::string::npos,
         "rank 0 names the failed send:", errors[0]);
  EXPECT(!errors[1].empty(), "rank 1 learns of it:", errors[1]);
  EXPECT(depth_after == 0, "the group is closed on the issuing thread, depth", depth_after.load());
  EXPECT(fake::nccl_stats().lost_aborts == 0, "ncclCommAbort ran inside an open group");
  EXPECT(fake::nccl_stats().aborts >= 2, "both ranks aborted their communicator");
}

// Finding 3: a call on cudaStreamPerThread over a non-blocking NCCL communicator must not hand
// NCCL that handle (NCCL launches from its own thread, where it names another stream).
void test_per_thread_stream_is_relayed() {
  fake::nccl_reset_stats();
  fake::clear_log();
  const auto errors = run_world(2, Tp::nccl, [](Rank& r) {
    for (const char* algo : {"nccl", "ring"}) {
      std::vector<int32_t> x(40), y(40, -1);
      for (int i = 0; i < 40; ++i) x[size_t(i)] = (r.rank + 1) * i;
      call_and_wait(r, Coll::allreduce, dev(x.data(), 160, DType::i32, cudaStreamPerThread),
                    dev(y.data(), 160, DType::i32, cudaStreamPerThread), RedOp::sum, algo);
      for (int i = 0; i < 40; ++i) EXPECT(y[size_t(i)] == 3 * i, algo, "i", i, "got", y[size_t(i)]);
    }
  });
  EXPECT(errors[0].empty() && errors[1].empty(), errors[0], errors[1]);
  EXPECT(fake::nccl_stats().ptds_launches == 0, "NCCL got cudaStreamPerThread",
         fake::nccl_stats().ptds_launches.load(), "times");
  int caller_waits = 0;
  for (const auto& w : fake::stream_waits()) caller_waits += w.first == cudaStreamPerThread;
  EXPECT(caller_waits >= 4, "the caller's stream waits for every relayed call", caller_waits);
}

// Finding 4: an abort asked for while another thread holds the call lock (a waiter checking its
// finished call) is carried out by that thread, not lost.
void test_abort_meeting_the_call_lock_is_not_lost() {
  fake::nccl_reset_stats();
  const auto errors = run_world(1, Tp::nccl, [](Rank& r) {
    std::vector<float> x(16, 1.0f);
    r.q->call(Coll::allreduce, dev(x.data(), 64, DType::f32, r.stream),
              dev(x.data(), 64, DType::f32, r.stream), RedOp::sum, 0, -1, "nccl", 30, nullptr);
    cudaStreamSynchronize(r.stream);
    std::atomic<int> step{0};
    std::thread waiter([&] {
      // check_done holds the call lock while it reads NCCL's async error: hold it there.
      fake::nccl_on_async_error([&] {
        step = 1;
        while (step != 2) std::this_thread::yield();
      });
      GpuEvent ev(std::static_pointer_cast<GpuWork>(r.q), r.stream, 30);
      try {
        ev.wait(-1);
      } catch (const PlaitError&) {
      }
    });
    while (step != 1) std::this_thread::yield();
    try {
      r.q->poll_pending(0);  // its deadline passed: abort, but the lock is taken
    } catch (const TimeoutError&) {
    }
    EXPECT(fake::nccl_stats().aborts == 0, "the lock holder is still inside NCCL");
    step = 2;
    waiter.join();
    EXPECT(fake::nccl_stats().aborts == 1, "the abort was lost: NCCL kernels would keep spinning");
  });
  EXPECT(errors[0].empty(), errors[0]);
}

}  // namespace host
