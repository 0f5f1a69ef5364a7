// Element types, reduction operators and collectives shared by every part of plait.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace plait {

// Order matters: the Python side and the segment's fingerprints use these codes.
enum class DType : uint8_t { f16 = 0, bf16, f32, f64, i8, u8, i32, i64, boolean, kCount };
enum class RedOp : uint8_t { sum = 0, prod, min, max, avg, kCount };
enum class Device : uint8_t { cpu = 0, cuda };
enum class Coll : uint8_t {
  allreduce = 0,
  reduce_scatter,
  allgather,
  broadcast,
  reduce,
  alltoall,
  barrier,
  send,
  recv,
  kCount
};

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(RedOp op);
const char* coll_name(Coll c);
Coll coll_named(const std::string& name);  // InvalidArgument if none
bool is_float(DType t);

// A timeout in seconds as the nanoseconds a GPU wait kernel compares with %globaltimer: 0 for
// <= 0 or NaN; at most 2^62 (about 146 years), so inf or huge values do not overflow (converting
// a double beyond uint64's range is undefined behaviour).
inline uint64_t gpu_timeout_ns(double seconds) {
  constexpr uint64_t kMax = uint64_t(1) << 62;
  if (!(seconds > 0)) return 0;
  if (seconds >= double(kMax) * 1e-9) return kMax;
  return uint64_t(seconds * 1e9);
}

}  // namespace plait
