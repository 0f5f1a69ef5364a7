// Ring reduce-scatter, allgather and allreduce over NCCL point-to-point, reducing with plait's
// kernels, on the caller's stream.
//
// reduce_scatter: per window of chunk_elems of each block, n - 1 steps; step s sends the partial
// of block (r - s - 1) to the right (the input block itself at step 0), receives the left's
// partial of block (r - s - 2) into scratch and adds this rank's input block to it; the last step
// writes block r, finished, into the output (avg: that step divides the sum by n, as the CPU
// path does). Each rank sends and receives (n - 1) / n of the input.
// allgather: n - 1 steps straight between output blocks; each rank sends (n - 1) blocks.
// allreduce: the vector in rounds of n chunks, each round a reduce-scatter then an allgather in
// place in the output: 2 (n - 1) steps, 2 (n - 1) / n of the vector sent per rank.
// Each step is one ncclGroupStart/End with one send and one recv, then (reduce steps) one kernel.
// All of it is ordered on one stream, so a step's send waits for the previous step's kernel:
// chunks bound scratch memory but do not yet overlap transfer with arithmetic.
#include "algo/gpu_algo.h"

namespace plait {

void gpu_reduce_scatter_ring(GpuCtx& c) {
  const int64_t m = c.a.count;
  const int n = c.size;
  if (n == 1) return c.copy(c.a.out, c.a.in, m);
  const RingPlan p = ring_plan(c.rank, n);
  for (const Span& w : chunk_plan(m, c.chunk_elems)) {
    const size_t bytes = c.bytes(w.count);
    for (int s = 0; s + 1 < n; ++s) {
      const RingStep& st = p.reduce_scatter[size_t(s)];
      const void* partial = s == 0 ? static_cast<const void*>(c.in_at(st.send_block * m + w.offset))
                                   : c.scratch_at(1);
      c.ops.group_start();
      c.ops.send(partial, bytes, p.right);
      c.ops.recv(c.scratch_at(0), bytes, p.left);
      c.ops.group_end();
      const bool last = s + 2 == n;
      c.reduce(last ? c.out_at(w.offset) : c.scratch_at(1), c.in_at(st.recv_block * m + w.offset),
               c.scratch_at(0), w.count, last);
    }
  }
}

void gpu_allgather_ring(GpuCtx& c) {
  const int64_t m = c.a.count;
  c.copy(c.out_at(c.rank * m), c.a.in, m);
  if (c.size == 1 || m == 0) return;
  const RingPlan p = ring_plan(c.rank, c.size);
  for (const RingStep& st : p.allgather) {
    c.ops.group_start();
    c.ops.send(c.out_at(st.send_block * m), c.bytes(m), p.right);
    c.ops.recv(c.out_at(st.recv_block * m), c.bytes(m), p.left);
    c.ops.group_end();
  }
}

void gpu_allreduce_ring(GpuCtx& c) {
  const int n = c.size;
  c.copy(c.a.out, c.a.in, c.a.count);
  if (n == 1) return;  // avg over one rank divides by 1: the copy is the result
  const RingPlan p = ring_plan(c.rank, n);
  for (const Span& r : chunk_plan(c.a.count, c.chunk_elems * n)) {
    const auto block = [&](int b) {
      const int64_t lo = part_begin(r.count, n, b), hi = part_begin(r.count, n, b + 1);
      return Span{r.offset + lo, hi - lo};
    };
    for (int s = 0; s + 1 < n; ++s) {
      const Span out = block(p.reduce_scatter[size_t(s)].send_block),
                 in = block(p.reduce_scatter[size_t(s)].recv_block);
      c.ops.group_start();
      if (out.count) c.ops.send(c.out_at(out.offset), c.bytes(out.count), p.right);
      if (in.count) c.ops.recv(c.scratch_at(0), c.bytes(in.count), p.left);
      c.ops.group_end();
      // The last reduce-scatter step finishes the block (avg: divides the sum).
      c.reduce(c.out_at(in.offset), c.out_at(in.offset), c.scratch_at(0), in.count, s + 2 == n);
    }
    for (const RingStep& st : p.allgather) {
      const Span out = block(st.send_block), in = block(st.recv_block);
      c.ops.group_start();
      if (out.count) c.ops.send(c.out_at(out.offset), c.bytes(out.count), p.right);
      if (in.count) c.ops.recv(c.out_at(in.offset), c.bytes(in.count), p.left);
      c.ops.group_end();
    }
  }
}

}  // namespace plait
