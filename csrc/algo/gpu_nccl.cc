// NCCL's own collectives, in the table as "nccl" so that auto and the bench can weigh plait's
// algorithms against them. bool travels as uint8 (sum/max = or = max, prod/min = and = min); avg
// is ncclAvg. One NCCL call each; NCCL chooses its own algorithm and protocol.
#include "algo/gpu_algo.h"
#include "core/errors.h"

namespace plait {
namespace {

nccl::DataType nccl_type(DType t) {
  switch (t) {
    case DType::f16: return nccl::Float16;
    case DType::bf16: return nccl::Bfloat16;
    case DType::f32: return nccl::Float32;
    case DType::f64: return nccl::Float64;
    case DType::i8: return nccl::Int8;
    case DType::u8:
    case DType::boolean: return nccl::Uint8;
    case DType::i32: return nccl::Int32;
    case DType::i64: return nccl::Int64;
    case DType::kCount: break;
  }
  throw InvalidArgument("nccl: bad dtype code");
}

nccl::RedOp nccl_op(DType t, RedOp op) {
  if (t == DType::boolean) return op == RedOp::sum || op == RedOp::max ? nccl::Max : nccl::Min;
  switch (op) {
    case RedOp::sum: return nccl::Sum;
    case RedOp::prod: return nccl::Prod;
    case RedOp::min: return nccl::Min;
    case RedOp::max: return nccl::Max;
    case RedOp::avg: return nccl::Avg;
    case RedOp::kCount: break;
  }
  throw InvalidArgument("nccl: bad op code");
}

}  // namespace

void gpu_allreduce_nccl(GpuCtx& c) {
  c.ops.all_reduce(c.a.in, c.a.out, size_t(c.a.count), nccl_type(c.a.dtype), nccl_op(c.a.dtype, c.a.op));
}

void gpu_reduce_scatter_nccl(GpuCtx& c) {
  c.ops.reduce_scatter(c.a.in, c.a.out, size_t(c.a.count), nccl_type(c.a.dtype), nccl_op(c.a.dtype, c.a.op));
}

void gpu_allgather_nccl(GpuCtx& c) { c.ops.all_gather(c.a.in, c.a.out, c.bytes(c.a.count)); }

}  // namespace plait
