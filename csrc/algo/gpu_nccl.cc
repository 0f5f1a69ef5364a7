// NCCL's own collectives, in the table as "nccl" so that auto and the bench can weigh plait's
// algorithms against them. bool travels as uint8 (sum/max = or = max, prod/min = and = min); avg
// is ncclAvg. One NCCL call each (alltoall: one group of a send and a receive per peer); NCCL
// chooses its own algorithm and protocol. Broadcast, alltoall and point-to-point move bytes.
// NCCL has no tags: GPU send/recv between two ranks match in issue order (plait refuses a tag).
#include "algo/gpu_algo.h"
#include "core/errors.h"

namespace plait {
namespace {

nccl::DataType nccl_type(DType t) {
  switch (t) {
    case DType::f16:
      return nccl::Float16;
    case DType::bf16:
      return nccl::Bfloat16;
    case DType::f32:
      return nccl::Float32;
    case DType::f64:
      return nccl::Float64;
    case DType::i8:
      return nccl::Int8;
    case DType::u8:
    case DType::boolean:
      return nccl::Uint8;
    case DType::i32:
      return nccl::Int32;
    case DType::i64:
      return nccl::Int64;
    case DType::kCount:
      break;
  }
  throw InvalidArgument("nccl: bad dtype code");
}

nccl::RedOp nccl_op(DType t, RedOp op) {
  if (t == DType::boolean) return op == RedOp::sum || op == RedOp::max ? nccl::Max : nccl::Min;
  switch (op) {
    case RedOp::sum:
      return nccl::Sum;
    case RedOp::prod:
      return nccl::Prod;
    case RedOp::min:
      return nccl::Min;
    case RedOp::max:
      return nccl::Max;
    case RedOp::avg:
      return nccl::Avg;
    case RedOp::kCount:
      break;
  }
  throw InvalidArgument("nccl: bad op code");
}

}  // namespace

void gpu_allreduce_nccl(GpuCtx& c) {
  c.ops.all_reduce(c.a.in, c.a.out, size_t(c.a.count), nccl_type(c.a.dtype),
                   nccl_op(c.a.dtype, c.a.op));
}

void gpu_reduce_scatter_nccl(GpuCtx& c) {
  c.ops.reduce_scatter(c.a.in, c.a.out, size_t(c.a.count), nccl_type(c.a.dtype),
                       nccl_op(c.a.dtype, c.a.op));
}

void gpu_allgather_nccl(GpuCtx& c) { c.ops.all_gather(c.a.in, c.a.out, c.bytes(c.a.count)); }

void gpu_broadcast_nccl(GpuCtx& c) {
  // A non-root's input is not read; in place on the root is out == in.
  c.ops.broadcast(c.a.in, c.a.out, c.bytes(c.a.count), c.a.root);
}

void gpu_reduce_nccl(GpuCtx& c) {
  // recvbuff is used only on the root; a non-root passes its input, as torch does, never null.
  void* out = c.rank == c.a.root ? c.a.out : const_cast<void*>(c.a.in);
  c.ops.reduce(c.a.in, out, size_t(c.a.count), nccl_type(c.a.dtype), nccl_op(c.a.dtype, c.a.op),
               c.a.root);
}

void gpu_alltoall_nccl(GpuCtx& c) {
  // Block j of in goes to rank j, block j of out comes from rank j; the own block is a copy.
  const int64_t block = c.a.count;  // per peer, as CallArgs counts alltoall
  c.copy(c.out_at(c.rank * block), c.in_at(c.rank * block), block);
  if (block == 0 || c.size == 1) return;
  c.ops.group_start();
  for (int k = 1; k < c.size;
       ++k) {  // peers in the order rank + 1, rank + 2, ...: no two ranks start on the same one
    const int to = (c.rank + k) % c.size, from = (c.rank - k + c.size) % c.size;
    c.ops.send(c.in_at(to * block), c.bytes(block), to);
    c.ops.recv(c.out_at(from * block), c.bytes(block), from);
  }
  c.ops.group_end();
}

void gpu_send_nccl(GpuCtx& c) { c.ops.send(c.a.in, c.bytes(c.a.count), c.a.peer); }
void gpu_recv_nccl(GpuCtx& c) { c.ops.recv(c.a.out, c.bytes(c.a.count), c.a.peer); }

}  // namespace plait
