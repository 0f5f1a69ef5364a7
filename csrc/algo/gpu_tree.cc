// Tree allreduce over NCCL point-to-point: a binary tree in heap order rooted at rank 0
// (tree_links). Up: per chunk, a rank receives its children's partials into two scratch slots
// (one group), adds them to its own input in one kernel and sends the result to its parent; the
// root's kernel finishes the sum (avg: divides it by n there, as the CPU path does). Partials are
// float32 for f16/bf16, so the sum rounds once. Down: per chunk, it receives
// the finished chunk from its parent into the output and sends it to its children. 2 ceil(log2 n)
// hops of latency against the ring's 2 (n - 1); an inner rank sends 3 and receives 3 copies of the
// vector. Up and down are separate passes over the chunks, so different levels of the tree work on
// different chunks at once (the tree pipelines across GPUs); within one GPU it is one stream.
#include <vector>

#include "algo/gpu_algo.h"

namespace plait {

void gpu_allreduce_tree(GpuCtx& c) {
  if (c.size == 1) return c.copy(c.a.out, c.a.in, c.a.count);  // avg over one rank divides by 1
  const TreeLinks t = tree_links(c.rank, c.size);
  const std::vector<Span> chunks = chunk_plan(c.a.count, c.chunk_partials());
  // Up: children's partials arrive in slots 0 and 1 (float32 for f16/bf16, as the CPU's tree);
  // a leaf sends its input (widened into slot 0 first where partials are wider), an inner rank
  // its input plus its children's, made in slot 0 in place, and the root finishes the sum into
  // the output (avg: divides it there, once).
  const bool widen = c.psize() != c.esize;
  for (const Span& ch : chunks) {
    const size_t pbytes = size_t(ch.count) * c.psize();
    const char* in = c.in_at(ch.offset);
    if (!t.children.empty()) {
      c.ops.group_start();
      for (size_t i = 0; i < t.children.size(); ++i)
        c.ops.recv(c.scratch_at(int(i)), pbytes, t.children[i]);
      c.ops.group_end();
      std::vector<const void*> srcs{in};
      for (size_t i = 0; i < t.children.size(); ++i) srcs.push_back(c.scratch_at(int(i)));
      const uint32_t kids = t.children.size() == 2 ? 6u : 2u;  // srcs 1 (and 2) are partials
      if (t.parent < 0)
        c.reduce_n(c.out_at(ch.offset), srcs, ch.count, true, kids, false);
      else
        c.reduce_n(c.scratch_at(0), srcs, ch.count, false, kids, true);
    } else if (widen) {
      c.to_partials(c.scratch_at(0), in, ch.count);
    }
    if (t.parent >= 0) {
      const bool own = t.children.empty() && !widen;  // a leaf whose partials are its elements
      c.ops.group_start();
      c.ops.send(own ? static_cast<const void*>(in) : c.scratch_at(0), pbytes, t.parent);
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
