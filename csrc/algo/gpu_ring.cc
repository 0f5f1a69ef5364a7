// Ring reduce-scatter, allgather and allreduce over NCCL point-to-point, reducing with plait's
// kernels, on the caller's stream.
//
// reduce_scatter: per window of each block (as many elements as a scratch slot holds as
// partials), n - 1 steps; step s sends the partial of block (r - s - 1) to the right (the input
// block itself at step 0), receives the left's partial of block (r - s - 2) into scratch and adds
// this rank's input block to it. Partials are float32 for f16/bf16, so a sum rounds once, as on
// the CPU; the last step writes block r, finished, into the output (avg: that step divides the
// sum by n). Each rank sends and receives (n - 1) / n of the input.
// allgather: n - 1 steps straight between output blocks; each rank sends (n - 1) blocks.
// allreduce: the vector in rounds of n chunks, each round a reduce-scatter (partials in scratch)
// then an allgather in place in the output: 2 (n - 1) steps, 2 (n - 1) / n of the vector sent per
// rank. Each step is one ncclGroupStart/End with one send and one recv, then (reduce steps) one
// kernel. All of it is ordered on one stream, so a step's send waits for the previous step's
// kernel: chunks bound scratch memory but do not yet overlap transfer with arithmetic.
#include "algo/gpu_algo.h"

namespace plait {

void gpu_reduce_scatter_ring(GpuCtx& c) {
  const int64_t m = c.a.count;
  const int n = c.size;
  if (n == 1) return c.copy(c.a.out, c.a.in, m);
  const RingPlan p = ring_plan(c.rank, n);
  for (const Span& w : chunk_plan(m, c.chunk_partials())) {
    for (int s = 0; s + 1 < n; ++s) {
      const RingStep& st = p.reduce_scatter[size_t(s)];
      // Step 0 passes the input block as is, later steps partials (float32 for f16/bf16).
      const size_t bytes = size_t(w.count) * (s == 0 ? c.esize : c.psize());
      const void* partial = s == 0 ? static_cast<const void*>(c.in_at(st.send_block * m + w.offset))
                                   : c.scratch_at(1);
      c.ops.group_start();
      c.ops.send(partial, bytes, p.right);
      c.ops.recv(c.scratch_at(0), bytes, p.left);
      c.ops.group_end();
      const bool last = s + 2 == n;
      c.reduce(last ? c.out_at(w.offset) : c.scratch_at(1), c.scratch_at(0),
               c.in_at(st.recv_block * m + w.offset), w.count, last, s > 0, !last);
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
  if (n == 1) return c.copy(c.a.out, c.a.in, c.a.count);  // avg over one rank divides by 1
  const RingPlan p = ring_plan(c.rank, n);
  for (const Span& r : chunk_plan(c.a.count, c.chunk_partials() * n)) {
    const auto block = [&](int b) {
      const int64_t lo = part_begin(r.count, n, b), hi = part_begin(r.count, n, b + 1);
      return Span{r.offset + lo, hi - lo};
    };
    // Reduce-scatter as gpu_reduce_scatter_ring's, partials in the scratch slots: a block's
    // partial is sent on at the step after it was made (send_block of step s is recv_block of
    // step s - 1), and the last step writes it, finished, into the output.
    for (int s = 0; s + 1 < n; ++s) {
      const Span out = block(p.reduce_scatter[size_t(s)].send_block),
                 in = block(p.reduce_scatter[size_t(s)].recv_block);
      const size_t unit = s == 0 ? c.esize : c.psize();
      c.ops.group_start();
      if (out.count)
        c.ops.send(s == 0 ? static_cast<const void*>(c.in_at(out.offset)) : c.scratch_at(1),
                   size_t(out.count) * unit, p.right);
      if (in.count) c.ops.recv(c.scratch_at(0), size_t(in.count) * unit, p.left);
      c.ops.group_end();
      const bool last = s + 2 == n;
      c.reduce(last ? c.out_at(in.offset) : c.scratch_at(1), c.scratch_at(0), c.in_at(in.offset),
               in.count, last, s > 0, !last);
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
