// Element types and reduction operators shared by every part of plait.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace plait {

// Order matters: the Python side and the segment's fingerprints use these codes.
enum class DType : uint8_t { f16 = 0, bf16, f32, f64, i8, u8, i32, i64, boolean, kCount };
enum class RedOp : uint8_t { sum = 0, prod, min, max, avg, kCount };
enum class Device : uint8_t { cpu = 0, cuda };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
const char* op_name(RedOp op);
bool is_float(DType t);

}  // namespace plait
