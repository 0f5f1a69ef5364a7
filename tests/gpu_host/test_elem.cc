// The reduction kernels' arithmetic per element (reduce/reduce_elem.h, the code reduce_cuda.cu's
// kernels run), compiled for the host and compared bitwise with the CPU kernels (reduce/reduce.h)
// for every dtype and op over edge values (zeros of both signs, NaN, inf, the integer limits and
// wrap-around, subnormals, the halves' rounding boundaries), every pair of them.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "reduce/reduce.h"
#include "reduce/reduce_elem.h"
#include "world.h"

namespace host {
namespace {

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

template <class T, class Op>
void compare(DType t, RedOp op, const std::vector<T>& vals) {
  const size_t n = vals.size() * vals.size();
  std::vector<T> a, b, gpu(n), cpu(n);
  for (const T& x : vals)
    for (const T& y : vals) a.push_back(x), b.push_back(y);
  for (size_t i = 0; i < n; ++i) gpu[i] = elem::apply<T, Op>(a[i], b[i], AvgScale{});
  const void* srcs[2] = {a.data(), b.data()};
  reduce(t, op, cpu.data(), srcs, 2, n, 0);
  for (size_t i = 0; i < n; ++i) {
    // NaN payloads aside (which NaN a sum keeps follows the compiler, reduce_cpu.cc says): a NaN
    // must meet a NaN; every other result must be the same bits.
    const auto wg = elem::widen(gpu[i]), wc = elem::widen(cpu[i]);
    if (wg != wg && wc != wc) continue;
    EXPECT(std::memcmp(&gpu[i], &cpu[i], sizeof(T)) == 0, "element function differs from the CPU",
           dtype_name(t), op_name(op), "pair", i, "gpu", double(wg), "cpu", double(wc));
  }
}

template <class T>
void all_ops(DType t, const std::vector<T>& v) {
  compare<T, elem::Sum>(t, RedOp::sum, v);
  compare<T, elem::Prod>(t, RedOp::prod, v);
  compare<T, elem::Min>(t, RedOp::min, v);
  compare<T, elem::Max>(t, RedOp::max, v);
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

}  // namespace host
