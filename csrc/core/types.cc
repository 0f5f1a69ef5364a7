#include "core/types.h"

#include "core/errors.h"

namespace plait {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16:
      return 2;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::i8:
    case DType::u8:
    case DType::boolean:
      return 1;
    case DType::kCount:
      break;
  }
  // A size of 0 would turn a bad code into silently empty buffers, so refuse it.
  throw InvalidArgument("unknown dtype code " + std::to_string(static_cast<int>(t)));
}

// The name functions feed error messages, so an out-of-range code yields a marker, not a throw.
const char* dtype_name(DType t) {
  switch (t) {
    case DType::f16:
      return "float16";
    case DType::bf16:
      return "bfloat16";
    case DType::f32:
      return "float32";
    case DType::f64:
      return "float64";
    case DType::i8:
      return "int8";
    case DType::u8:
      return "uint8";
    case DType::i32:
      return "int32";
    case DType::i64:
      return "int64";
    case DType::boolean:
      return "bool";
    case DType::kCount:
      break;
  }
  return "invalid-dtype";
}

const char* op_name(RedOp op) {
  switch (op) {
    case RedOp::sum:
      return "sum";
    case RedOp::prod:
      return "prod";
    case RedOp::min:
      return "min";
    case RedOp::max:
      return "max";
    case RedOp::avg:
      return "avg";
    case RedOp::kCount:
      break;
  }
  return "invalid-op";
}

bool is_float(DType t) {
  return t == DType::f16 || t == DType::bf16 || t == DType::f32 || t == DType::f64;
}

const char* coll_name(Coll c) {
  static const char* names[] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
                                "alltoall",  "barrier",        "send",      "recv"};
  return unsigned(c) < unsigned(Coll::kCount) ? names[unsigned(c)] : "?";
}

Coll coll_named(const std::string& name) {
  for (int c = 0; c < int(Coll::kCount); ++c)
    if (name == coll_name(Coll(c))) return Coll(c);
  throw InvalidArgument("unknown collective '" + name + "'");
}

}  // namespace plait
