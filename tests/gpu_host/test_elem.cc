// The reduction kernels' arithmetic per element (reduce/reduce_elem.h, the code reduce_cuda.cu's
// kernels run), compiled for the host and compared bitwise with the CPU kernels (reduce/reduce.h)
// for every dtype and op, avg included (sum, then divide), over edge values (zeros of both signs,
// NaN, inf, the integer limits and wrap-around, subnormals, the halves' rounding boundaries): every
// pair of them, and n-source reductions with float32 partials (sources and results) for the halves.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "reduce/reduce.h"
#include "reduce/reduce_elem.h"
#include "world.h"

namespace host {
namespace {

using elem::AccT;

template <class T>
std::vector<T> edge_values() {
  std::vector<T> v;
  if constexpr (std::is_floating_point<T>::value) {
    for (double x : {0.0, -0.0, 1.0, -1.0, 2.5, -3.75, 127.0, 1e-8, 3e38, -3e38, 65504.0,
                     1.0009765625, 0.333333333333, 1e300, -1e-310})
      v.push_back(T(x));
    v.push_back(std::numeric_limits<T>::quiet_NaN());
    v.push_back(std::numeric_limits<T>::infinity());
    v.push_back(-std::numeric_limits<T>::infinity());
    v.push_back(std::numeric_limits<T>::denorm_min());
  } else {
    for (int64_t x : {0, 1, -1, 2, 3, 100, -100, 127, -128, 255, 65537, -7})
      v.push_back(T(x));  // wraps into T, as numpy's astype does
    v.push_back(std::numeric_limits<T>::max());
    v.push_back(std::numeric_limits<T>::min());
    v.push_back(T(std::numeric_limits<T>::max() / 3 + 1));
  }
  return v;
}

template <class T>
std::vector<T> halves() {  // f16/bf16 from float values, edge ones included
  std::vector<T> v;
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 2.5f, 65504.0f, 65520.0f, 1.0009765625f, 0.1f, 3e38f,
                  6e-8f, 1e-40f, 333.3f, -7.125f})
    v.push_back(T(x));
  v.push_back(T(std::numeric_limits<float>::quiet_NaN()));
  v.push_back(T(std::numeric_limits<float>::infinity()));
  v.push_back(T(-std::numeric_limits<float>::infinity()));
  return v;
}

// Sources of n elements each, for both sides: src j's element i is vals[pick(i, j)], every
// combination when there are few, a fixed pseudo-random sample when not. A source marked partial
// holds accumulator values instead (float32 for the halves: `partials`, values a half cannot hold).
template <class T>
struct Sources {
  std::vector<std::vector<T>> elems;
  std::vector<std::vector<AccT<T>>> parts;
  std::vector<const void*> ptrs;
  size_t n = 0;
};

template <class T>
Sources<T> sources(const std::vector<T>& vals, const std::vector<AccT<T>>& partials, int nsrc,
                   uint32_t partial_srcs) {
  Sources<T> s;
  const size_t v = vals.size();
  size_t all = 1;
  for (int j = 0; j < nsrc; ++j) all *= v;
  s.n = std::min<size_t>(all, 30000);
  s.elems.resize(size_t(nsrc));
  s.parts.resize(size_t(nsrc));
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (int j = 0; j < nsrc; ++j) {
    const bool partial = (partial_srcs >> j) & 1u;
    size_t stride = 1;
    for (int k = 0; k < j; ++k) stride *= v;
    for (size_t i = 0; i < s.n; ++i) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const size_t r = s.n == all ? i / stride : size_t(x >> 33);
      if (partial)
        s.parts[size_t(j)].push_back(partials[r % partials.size()]);
      else
        s.elems[size_t(j)].push_back(vals[r % v]);
    }
    s.ptrs.push_back(partial ? static_cast<const void*>(s.parts[size_t(j)].data())
                             : static_cast<const void*>(s.elems[size_t(j)].data()));
  }
  return s;
}

template <class A>
bool same_bits(const A& g, const A& c) {
  // NaN payloads aside (which NaN a sum keeps follows the compiler, reduce_cpu.cc says): a NaN
  // must meet a NaN; every other result must be the same bits.
  const auto wg = elem::widen(g), wc = elem::widen(c);
  return (wg != wg && wc != wc) || std::memcmp(&g, &c, sizeof(A)) == 0;
}

// srcs[0] op ... op srcs[nsrc-1] through the element functions (the kernels' code, the divisor
// passed only for avg as reduce_cuda does) against plait::reduce, result as elements or, with
// partial_dst, as unrounded partials.
template <class T, class Op>
void compare_n(DType t, RedOp op, const std::vector<T>& vals, const std::vector<AccT<T>>& partials,
               int nsrc, uint32_t partial_srcs, int divisor, bool partial_dst) {
  const Sources<T> s = sources(vals, partials, nsrc, partial_srcs);
  const int d = op == RedOp::avg ? divisor : 0;
  std::vector<T> cpu(s.n), gpu(s.n);
  std::vector<AccT<T>> cpu_p(s.n), gpu_p(s.n);
  for (size_t i = 0; i < s.n; ++i) {
    const AccT<T> acc = elem::reduce_at<T, Op>(s.ptrs.data(), nsrc, partial_srcs, int64_t(i), d);
    if (partial_dst)
      gpu_p[i] = acc;
    else
      gpu[i] = elem::narrow<T>(acc);
  }
  reduce(t, op, partial_dst ? static_cast<void*>(cpu_p.data()) : static_cast<void*>(cpu.data()),
         s.ptrs.data(), nsrc, s.n, divisor, partial_srcs, partial_dst);
  for (size_t i = 0; i < s.n; ++i) {
    const bool ok = partial_dst ? same_bits(gpu_p[i], cpu_p[i]) : same_bits(gpu[i], cpu[i]);
    EXPECT(ok, "element functions differ from the CPU:", dtype_name(t), op_name(op), "nsrc", nsrc,
           "partial_srcs", partial_srcs, "partial_dst", int(partial_dst), "divisor", divisor,
           "element", i, "gpu", partial_dst ? double(gpu_p[i]) : double(elem::widen(gpu[i])), "cpu",
           partial_dst ? double(cpu_p[i]) : double(elem::widen(cpu[i])));
  }
}

// Two elements through elem::apply (the two-source kernels' code) against plait::reduce.
template <class T, class Op>
void compare(DType t, RedOp op, const std::vector<T>& vals, int divisor = 0) {
  const Sources<T> s = sources(vals, {}, 2, 0);
  const int d = op == RedOp::avg ? divisor : 0;
  std::vector<T> gpu(s.n), cpu(s.n);
  for (size_t i = 0; i < s.n; ++i) gpu[i] = elem::apply<T, Op>(s.elems[0][i], s.elems[1][i], d);
  reduce(t, op, cpu.data(), s.ptrs.data(), 2, s.n, divisor);
  for (size_t i = 0; i < s.n; ++i)
    EXPECT(same_bits(gpu[i], cpu[i]), "element function differs from the CPU", dtype_name(t),
           op_name(op), "divisor", divisor, "pair", i, "gpu", double(elem::widen(gpu[i])), "cpu",
           double(elem::widen(cpu[i])));
}

template <class T>
void all_ops(DType t, const std::vector<T>& v) {
  compare<T, elem::Sum>(t, RedOp::sum, v);
  compare<T, elem::Prod>(t, RedOp::prod, v);
  compare<T, elem::Min>(t, RedOp::min, v);
  compare<T, elem::Max>(t, RedOp::max, v);
  if constexpr (std::is_floating_point<AccT<T>>::value) {
    for (int d : {1, 2, 3, 7}) compare<T, elem::Sum>(t, RedOp::avg, v, d);
  }
}

template <class T>
std::vector<AccT<T>> partial_values() {
  return edge_values<AccT<T>>();
}

// n-source reductions, 3 to 6 sources, elements and partials mixed in every pattern of the first
// three, results as elements and as partials, avg over 3 and 8 ranks.
template <class T>
void all_ops_n(DType t, const std::vector<T>& v) {
  const std::vector<AccT<T>> p = partial_values<T>();
  for (int nsrc : {3, 4, 6}) {
    for (uint32_t mask : {0u, 1u, 2u, 5u, 6u, 7u}) {
      for (bool pdst : {false, true}) {
        compare_n<T, elem::Sum>(t, RedOp::sum, v, p, nsrc, mask, 0, pdst);
        compare_n<T, elem::Prod>(t, RedOp::prod, v, p, nsrc, mask, 0, pdst);
        compare_n<T, elem::Min>(t, RedOp::min, v, p, nsrc, mask, 0, pdst);
        compare_n<T, elem::Max>(t, RedOp::max, v, p, nsrc, mask, 0, pdst);
        if constexpr (std::is_floating_point<AccT<T>>::value) {
          compare_n<T, elem::Sum>(t, RedOp::avg, v, p, nsrc, mask, 3, pdst);
          compare_n<T, elem::Sum>(t, RedOp::avg, v, p, nsrc, mask, 8, pdst);
        }
      }
    }
  }
}

}  // namespace

void test_element_functions_match_the_cpu() {
  all_ops<float>(DType::f32, edge_values<float>());
  all_ops<double>(DType::f64, edge_values<double>());
  all_ops<int8_t>(DType::i8, edge_values<int8_t>());
  all_ops<uint8_t>(DType::u8, edge_values<uint8_t>());
  all_ops<int32_t>(DType::i32, edge_values<int32_t>());
  all_ops<int64_t>(DType::i64, edge_values<int64_t>());
  all_ops<__half>(DType::f16, halves<__half>());
  all_ops<__nv_bfloat16>(DType::bf16, halves<__nv_bfloat16>());
  const std::vector<uint8_t> bools = {0, 1};
  compare<uint8_t, elem::Or>(DType::boolean, RedOp::sum, bools);
  compare<uint8_t, elem::Or>(DType::boolean, RedOp::max, bools);
  compare<uint8_t, elem::And>(DType::boolean, RedOp::prod, bools);
  compare<uint8_t, elem::And>(DType::boolean, RedOp::min, bools);
}

void test_element_functions_float32_partials() {
  all_ops_n<__half>(DType::f16, halves<__half>());
  all_ops_n<__nv_bfloat16>(DType::bf16, halves<__nv_bfloat16>());
  all_ops_n<float>(DType::f32, edge_values<float>());
  all_ops_n<double>(DType::f64, edge_values<double>());
  all_ops_n<int8_t>(DType::i8, edge_values<int8_t>());
  all_ops_n<int64_t>(DType::i64, edge_values<int64_t>());
  for (int nsrc : {3, 5}) {
    compare_n<uint8_t, elem::Or>(DType::boolean, RedOp::sum, {0, 1}, {0, 1}, nsrc, 0, 0, false);
    compare_n<uint8_t, elem::And>(DType::boolean, RedOp::min, {0, 1}, {0, 1}, nsrc, 0, 0, false);
  }
  // Eight fp16 ranks near 1e4: the float32 sum (8e4) is past fp16's range, the average is not.
  // One rounding at the end keeps it finite and exact, as on the CPU.
  const std::vector<__half> big = {__half(10000.0f)};
  std::vector<std::vector<__half>> in(8, big);
  std::vector<const void*> ptrs;
  for (auto& x : in) ptrs.push_back(x.data());
  const __half avg =
      elem::narrow<__half>(elem::reduce_at<__half, elem::Sum>(ptrs.data(), 8, 0, 0, 8));
  EXPECT(elem::widen(avg) == 10000.0f, "fp16 avg of eight 1e4 got", double(elem::widen(avg)));
}

}  // namespace host
