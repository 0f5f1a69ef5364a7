// The NCCL-based GPU algorithms (ring, tree, NCCL's own rows), unchanged, over the fake NCCL and
// runtime: every collective's closed-form result on every rank, for worlds of 1..5, counts that
// leave blocks empty and chunks that force many rounds (64-byte chunks), in place and out.
#include <cuda_fp16.h>

#include <cmath>

#include "world.h"

namespace host {
namespace {

int64_t f(int r, int64_t i) { return (r + 1) * (i % 11) + r; }
int64_t sum_f(int n, int64_t i) { return (i % 11) * n * (n + 1) / 2 + n * (n - 1) / 2; }

template <class T>
void check_allreduce(Rank& r, const std::string& algo, RedOp op, DType t, int64_t count,
                     bool in_place) {
  const int n = r.size;
  // avg: plait's rows sum, then divide once, as the CPU path (so 1/3 of a sum rounds once; rank
  // 0 adds 1 so that the sums are no multiples of 3); NCCL's row is NCCL's own arithmetic (a
  // PreMulSum by 1/n), exact only on multiples of n.
  const bool nccl_avg = op == RedOp::avg && algo == "nccl";
  const bool plait_avg = op == RedOp::avg && !nccl_avg;
  std::vector<T> in(static_cast<size_t>(count)), out(size_t(count), T(-7));
  for (int64_t i = 0; i < count; ++i)
    in[size_t(i)] = op == RedOp::max ? T(r.rank == i % n ? 1000 + i : i)
                    : nccl_avg       ? T(n * f(r.rank, i))
                                     : T(f(r.rank, i) + (plait_avg && r.rank == 0));
  T* o = in_place ? in.data() : out.data();
  call_and_wait(r, Coll::allreduce, dev(in.data(), in.size() * sizeof(T), t, r.stream),
                dev(o, in.size() * sizeof(T), t, r.stream), op, algo);
  for (int64_t i = 0; i < count; ++i) {
    const T want = op == RedOp::max ? T(1000 + i)
                   : plait_avg      ? T(T(sum_f(n, i) + 1) / T(n))
                                    : T(sum_f(n, i));
    EXPECT(o[i] == want, "allreduce", algo, op_name(op), dtype_name(t), "n", n, "rank", r.rank,
           "count", count, "i", i, "got", double(o[i]), "want", double(want));
  }
}

// fp16 allreduce (ring, tree) and reduce_scatter (ring): partials travel as float32 and the sum
// rounds once, so it is the CPU's (integer inputs: the float32 sum is exact; its one rounding to
// fp16 is the closed form); an average of 30000s stays 30000 though a sum of three is past fp16's
// range.
void check_half(Rank& r, const std::string& algo, RedOp op, int64_t count, bool in_place) {
  const int n = r.size;
  const auto v = [&](int rank, int64_t j) {
    return op == RedOp::avg ? 30000.0f : float(1000 + 37 * rank + j % 97);
  };
  const auto want = [&](int64_t j) {
    float sum = 0;
    for (int k = 0; k < n; ++k) sum += v(k, j);
    return __half2float(__half(op == RedOp::avg ? sum / float(n) : sum));
  };
  std::vector<__half> in(static_cast<size_t>(count)), out(size_t(count), __half(-7.0f));
  for (int64_t i = 0; i < count; ++i) in[size_t(i)] = __half(v(r.rank, i));
  __half* o = in_place ? in.data() : out.data();
  call_and_wait(r, Coll::allreduce, dev(in.data(), size_t(count) * 2, DType::f16, r.stream),
                dev(o, size_t(count) * 2, DType::f16, r.stream), op, algo);
  for (int64_t i = 0; i < count; ++i)
    EXPECT(__half2float(o[i]) == want(i), "fp16 allreduce", algo, op_name(op), "n", n, "rank",
           r.rank, "i", i, "got", __half2float(o[i]), "want", want(i));
  if (algo != "ring") return;
  std::vector<__half> all(static_cast<size_t>(n * count)), mine(size_t(count), __half(-7.0f));
  for (int64_t j = 0; j < n * count; ++j) all[size_t(j)] = __half(v(r.rank, j));
  call_and_wait(r, Coll::reduce_scatter, dev(all.data(), all.size() * 2, DType::f16, r.stream),
                dev(mine.data(), mine.size() * 2, DType::f16, r.stream), op, "ring");
  for (int64_t i = 0; i < count; ++i)
    EXPECT(__half2float(mine[size_t(i)]) == want(r.rank * count + i), "fp16 reduce_scatter ring",
           op_name(op), "n", n, "rank", r.rank, "i", i);
}

void check_others(Rank& r, const std::string& algo, int64_t count) {
  const int n = r.size;
  const auto bytes = [](size_t k) { return k * sizeof(int32_t); };
  if (algo == "nccl" || algo == "ring") {  // reduce_scatter
    std::vector<int32_t> in(static_cast<size_t>(n * count)), out(size_t(count), -7);
    for (int64_t j = 0; j < n * count; ++j) in[size_t(j)] = int32_t(f(r.rank, j));
    call_and_wait(r, Coll::reduce_scatter, dev(in.data(), bytes(in.size()), DType::i32, r.stream),
                  dev(out.data(), bytes(out.size()), DType::i32, r.stream), RedOp::sum, algo);
    for (int64_t i = 0; i < count; ++i)
      EXPECT(out[size_t(i)] == sum_f(n, r.rank * count + i), "reduce_scatter", algo, "n", n, "rank",
             r.rank, "i", i);
    std::vector<int32_t> mine(static_cast<size_t>(count)), all(size_t(n * count), -7);  // allgather
    for (int64_t i = 0; i < count; ++i) mine[size_t(i)] = int32_t(f(r.rank, i));
    call_and_wait(r, Coll::allgather, dev(mine.data(), bytes(mine.size()), DType::i32, r.stream),
                  dev(all.data(), bytes(all.size()), DType::i32, r.stream), RedOp::sum, algo);
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < count; ++i)
        EXPECT(all[size_t(p * count + i)] == f(p, i), "allgather", algo, "n", n, "block", p);
  }
  if (algo != "nccl") return;
  const int root = n - 1;  // broadcast, reduce, alltoall: NCCL's rows
  std::vector<int32_t> b(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) b[size_t(i)] = r.rank == root ? int32_t(3 * i + 1) : -7;
  call_and_wait(r, Coll::broadcast, dev(b.data(), bytes(b.size()), DType::i32, r.stream),
                dev(b.data(), bytes(b.size()), DType::i32, r.stream), RedOp::sum, algo, root);
  for (int64_t i = 0; i < count; ++i) EXPECT(b[size_t(i)] == 3 * i + 1, "broadcast n", n);
  std::vector<int32_t> x(static_cast<size_t>(count)), y(size_t(count), -7);
  for (int64_t i = 0; i < count; ++i) x[size_t(i)] = int32_t(f(r.rank, i));
  call_and_wait(r, Coll::reduce, dev(x.data(), bytes(x.size()), DType::i32, r.stream),
                r.rank == root ? dev(y.data(), bytes(y.size()), DType::i32, r.stream) : Buffer{},
                RedOp::sum, algo, root);
  for (int64_t i = 0; r.rank == root && i < count; ++i)
    EXPECT(y[size_t(i)] == sum_f(n, i), "reduce n", n);
  std::vector<int32_t> s(static_cast<size_t>(n * count)), t(size_t(n * count), -7);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < count; ++i)
      s[size_t(p * count + i)] = int32_t(1000 * r.rank + 10 * p + i % 10);
  call_and_wait(r, Coll::alltoall, dev(s.data(), bytes(s.size()), DType::i32, r.stream),
                dev(t.data(), bytes(t.size()), DType::i32, r.stream), RedOp::sum, algo);
  for (int p = 0; p < n; ++p)
    for (int64_t i = 0; i < count; ++i)
      EXPECT(t[size_t(p * count + i)] == 1000 * p + 10 * r.rank + i % 10, "alltoall n", n);
}

}  // namespace

void test_nccl_algorithms() {
  for (int n = 1; n <= 5; ++n) {
    fake::nccl_reset_stats();
    const auto errors = run_world(n, Tp::nccl, [](Rank& r) {
      for (int64_t count : {0, 1, 13, 301}) {
        for (const char* algo : {"nccl", "ring", "tree"}) {
          for (bool in_place : {false, true}) {
            check_allreduce<int32_t>(r, algo, RedOp::sum, DType::i32, count, in_place);
            check_allreduce<float>(r, algo, RedOp::avg, DType::f32, count, in_place);
            check_allreduce<int64_t>(r, algo, RedOp::max, DType::i64, count, in_place);
            if (algo != std::string("nccl")) {  // NCCL's own fp16 arithmetic is its own
              check_half(r, algo, RedOp::sum, count, in_place);
              check_half(r, algo, RedOp::avg, count, in_place);
            }
          }
          check_others(r, algo, count);
        }
      }
      r.q->finalize();
    });
    for (int rank = 0; rank < n; ++rank) EXPECT(errors[size_t(rank)].empty(), errors[size_t(rank)]);
    EXPECT(fake::nccl_stats().destroys == n, "finalize destroys every communicator");
    EXPECT(fake::nccl_stats().finalizes == n && fake::nccl_stats().unfinalized_destroys == 0,
           "ncclCommFinalize before ncclCommDestroy (review 2, finding 9)");
    EXPECT(fake::nccl_stats().aborts == 0 && fake::hangs() == 0, "no abort, no hang");
  }
}

}  // namespace host
