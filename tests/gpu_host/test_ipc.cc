// The CUDA IPC protocol (epochs, slots, kDone waits, poison, skip, give-up) with the unchanged
// algorithms and queue, ranks as threads over shared host memory with real atomics: mixed
// sequences of one_shot, two_shot and ring with random counts (staging of 4 KiB, so large calls
// take many rounds), random delays in every kernel, then faults: a rank that stops must make every
// other rank give up within the deadline, and teardown must hold.
#include <cuda_fp16.h>

#include <chrono>
#include <random>

#include "world.h"

namespace host {
namespace {

int64_t f(int r, int64_t i) { return (r + 1) * (i % 13) + 2 * r; }
int64_t sum_f(int n, int64_t i) { return (i % 13) * n * (n + 1) / 2 + n * (n - 1); }

struct Step {
  Coll coll;
  const char* algo;
  int64_t count;
  bool in_place;
  bool avg;  // float32 avg (sum, then divide once) instead of int32 sum
};

std::vector<Step> plan(uint32_t seed, int calls) {
  static const std::pair<Coll, const char*> rows[] = {
      {Coll::allreduce, "one_shot"},  {Coll::allreduce, "two_shot"},
      {Coll::allreduce, "ring"},      {Coll::reduce_scatter, "one_shot"},
      {Coll::reduce_scatter, "ring"}, {Coll::allgather, "one_shot"},
      {Coll::allgather, "ring"}};
  std::mt19937 rng(seed);  // the same on every rank: they make the same calls
  std::vector<Step> v;
  for (int k = 0; k < calls; ++k) {
    const auto& row = rows[rng() % 7];
    const int64_t count = std::vector<int64_t>{0, 1, 5, 63, 700, 2500}[rng() % 6];
    const bool ar = row.first == Coll::allreduce;
    v.push_back({row.first, row.second, count, ar && rng() % 2, ar && k % 2 == 0});
  }
  return v;
}

void run_step(Rank& r, const Step& s, double timeout_s) {
  const int n = r.size;
  const int64_t m = s.count;
  const int64_t ins = s.coll == Coll::reduce_scatter ? n * m : m;
  const int64_t outs = s.coll == Coll::allgather ? n * m : m;
  if (s.avg) {
    // The sum of integers is exact in float32 and one division rounds it, as on the CPU. Rank 0
    // adds 1 so that the sum is no multiple of 3: dividing each input first would round 3 times.
    std::vector<float> in(static_cast<size_t>(ins)), out(size_t(outs), -7);
    for (int64_t i = 0; i < ins; ++i) in[size_t(i)] = float(f(r.rank, i) + (r.rank == 0));
    float* o = s.in_place ? in.data() : out.data();
    call_and_wait(r, s.coll, dev(in.data(), size_t(ins) * 4, DType::f32, r.stream),
                  dev(o, size_t(outs) * 4, DType::f32, r.stream), RedOp::avg, s.algo, 0, timeout_s);
    for (int64_t i = 0; i < outs; ++i) {
      const float want = float(sum_f(n, i) + 1) / float(n);
      EXPECT(o[i] == want, "allreduce avg", s.algo, "n", n, "rank", r.rank, "count", m, "i", i,
             "got", o[i], "want", want);
    }
    return;
  }
  std::vector<int32_t> in(static_cast<size_t>(ins)), out(size_t(outs), -7);
  for (int64_t i = 0; i < ins; ++i) in[size_t(i)] = int32_t(f(r.rank, i));
  int32_t* o = s.in_place ? in.data() : out.data();
  call_and_wait(r, s.coll, dev(in.data(), size_t(ins) * 4, DType::i32, r.stream),
                dev(o, size_t(outs) * 4, DType::i32, r.stream), RedOp::sum, s.algo, 0, timeout_s);
  for (int64_t i = 0; i < outs; ++i) {
    const int64_t want = s.coll == Coll::allreduce ? sum_f(n, i)
                         : s.coll == Coll::reduce_scatter
                             ? sum_f(n, r.rank * m + i)
                             : f(int(i / std::max<int64_t>(m, 1)), i % std::max<int64_t>(m, 1));
    EXPECT(o[i] == want, coll_name(s.coll), s.algo, "n", n, "rank", r.rank, "count", m, "i", i,
           "got", o[i], "want", want);
  }
}

}  // namespace

void test_ipc_protocol() {
  fake::set_jitter_us(40);
  for (int n = 1; n <= 4; ++n) {
    const auto errors = run_world(n, Tp::ipc, [](Rank& r) {
      for (const Step& s : plan(7u + uint32_t(r.size), 24)) run_step(r, s, 20);
      r.q->finalize();
      r.barrier->wait();  // Communicator.finalize's barrier: peers' drains read our flags
    });
    for (int rank = 0; rank < n; ++rank)
      EXPECT(errors[size_t(rank)].empty(), "n", n, "rank", rank, errors[size_t(rank)]);
  }
  fake::set_jitter_us(0);
  EXPECT(fake::hangs() == 0, "no fake wait hit its hang limit");
}

// fp16 allreduce over 3 and 4 ranks by every IPC algorithm: the sum travels in float32 and is
// rounded once, so it equals the CPU's (integer inputs: the float32 sum is exact, and its one
// rounding to fp16 is the closed form), and an average of 30000s stays 30000 although a sum of
// three of them is past fp16's range. Staging of 4 KiB: the ring takes many rounds.
void test_ipc_half_partials() {
  for (int n : {3, 4}) {
    const auto errors = run_world(n, Tp::ipc, [](Rank& r) {
      const int64_t m = 1500;
      for (const char* algo : {"one_shot", "two_shot", "ring"}) {
        for (RedOp op : {RedOp::sum, RedOp::avg}) {
          const auto v = [&](int rank, int64_t i) {
            return op == RedOp::avg ? 30000 : int(1000 + 37 * rank + i % 97);
          };
          std::vector<__half> in(static_cast<size_t>(m)), out(size_t(m), __half(-7.0f));
          for (int64_t i = 0; i < m; ++i) in[size_t(i)] = __half(float(v(r.rank, i)));
          call_and_wait(r, Coll::allreduce, dev(in.data(), size_t(m) * 2, DType::f16, r.stream),
                        dev(out.data(), size_t(m) * 2, DType::f16, r.stream), op, algo, 0, 20);
          for (int64_t i = 0; i < m; ++i) {
            float sum = 0;
            for (int k = 0; k < r.size; ++k) sum += float(v(k, i));
            const float want = __half2float(__half(op == RedOp::avg ? sum / float(r.size) : sum));
            const float got = __half2float(out[size_t(i)]);
            EXPECT(got == want, "fp16 allreduce", algo, op_name(op), "n", r.size, "rank", r.rank,
                   "i", i, "got", got, "want", want);
          }
        }
      }
      r.q->finalize();
      r.barrier->wait();
    });
    for (int rank = 0; rank < n; ++rank)
      EXPECT(errors[size_t(rank)].empty(), "n", n, "rank", rank, errors[size_t(rank)]);
  }
}

// A rank that stops after two calls: the others' waits give up on their deadline (0.5 s), their
// posts carry the poison, every rank raises, and every queue is torn down without a hang.
void test_ipc_peer_stops() {
  for (int n : {2, 3}) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<double> took(static_cast<size_t>(n), -1);
    std::atomic<int> gave_up{0};
    const auto errors = run_world(n, Tp::ipc, [&](Rank& r) {
      const auto steps = plan(11, 3);
      run_step(r, {Coll::allreduce, "one_shot", 100, false}, 0.5);
      run_step(r, {Coll::allreduce, "ring", 3000, false}, 0.5);
      if (r.rank == n - 1) {  // stalls (its memory stays mapped): never makes the third call
        for (int i = 0; i < 2000 && gave_up < n - 1; ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        return;
      }
      const auto s = std::chrono::steady_clock::now();
      try {
        run_step(r, {Coll::allreduce, "two_shot", 3000, false}, 0.5);
        run_step(r, steps[0], 0.5);  // the error may surface at the next call
      } catch (...) {
        took[size_t(r.rank)] =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count();
        ++gave_up;
        throw;
      }
      ++gave_up;
    });
    const double all = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (int rank = 0; rank + 1 < n; ++rank) {
      const std::string& e = errors[size_t(rank)];
      EXPECT(e.find("within the deadline") != std::string::npos ||
                 e.find("poison") != std::string::npos || e.find("aborted") != std::string::npos,
             "n", n, "rank", rank, "gives up:", e);
      EXPECT(took[size_t(rank)] >= 0 && took[size_t(rank)] < 5, "n", n, "rank", rank, "took",
             took[size_t(rank)]);
    }
    EXPECT(all < 20, "the world, teardown included, took", all, "s");
  }
}

}  // namespace host
