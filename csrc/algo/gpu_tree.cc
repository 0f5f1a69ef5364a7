// Tree allreduce over NCCL point-to-point: a binary tree in heap order rooted at rank 0
// (tree_links). Up: per chunk, a rank receives its children's partials into two scratch slots
// (one group), adds them to its own and sends the result to its parent; the root's last addition
// finishes the sum (avg: divides it by n there, as the CPU path does). Down: per chunk, it receives
// the finished chunk from its parent into the output and sends it to its children. 2 ceil(log2 n)
// hops of latency against the ring's 2 (n - 1); an inner rank sends 3 and receives 3 copies of the
// vector. Up and down are separate passes over the chunks, so different levels of the tree work on
// different chunks at once (the tree pipelines across GPUs); within one GPU it is one stream.
#include "algo/gpu_algo.h"

namespace plait {

void gpu_allreduce_tree(GpuCtx& c) {
  c.copy(c.a.out, c.a.in, c.a.count);
  if (c.size == 1) return;
  const TreeLinks t = tree_links(c.rank, c.size);
  const std::vector<Span> chunks = chunk_plan(c.a.count, c.chunk_elems);
  for (const Span& ch : chunks) {
    const size_t bytes = c.bytes(ch.count);
    if (!t.children.empty()) {
      c.ops.group_start();
      for (size_t i = 0; i < t.children.size(); ++i)
        c.ops.recv(c.scratch_at(int(i)), bytes, t.children[i]);
      c.ops.group_end();
      for (size_t i = 0; i < t.children.size(); ++i)
        c.reduce(c.out_at(ch.offset), c.out_at(ch.offset), c.scratch_at(int(i)), ch.count,
                 t.parent < 0 && i + 1 == t.children.size());
    }
    if (t.parent >= 0) {
      c.ops.group_start();
      c.ops.send(c.out_at(ch.offset), bytes, t.parent);
      c.ops.group_end();
    }
  }
  for (const Span& ch : chunks) {
    const size_t bytes = c.bytes(ch.count);
    if (t.parent >= 0) {
      c.ops.group_start();
      c.ops.recv(c.out_at(ch.offset), bytes, t.parent);
      c.ops.group_end();
    }
    if (!t.children.empty()) {
      c.ops.group_start();
      for (int child : t.children) c.ops.send(c.out_at(ch.offset), bytes, child);
      c.ops.group_end();
    }
  }
}

}  // namespace plait
