// The schedules algorithms share across transports: plain C++ with no CUDA, compiled into every
// build so the CPU tests check them (plait._C.gpu_plan_*). A ring (ring_plan) or a tree
// (tree_links) is planned once here and executed by the host algorithms over shared-memory
// staging (allreduce_ring.cc, reduce_scatter_ring.cc, allgather_ring.cc, allreduce_tree.cc), by
// the GPU algorithms over NCCL send/recv (gpu_ring.cc, gpu_tree.cc) and over CUDA IPC epochs
// (ipc_ring.cc, through ipc_ring_plan); only how a step moves its block differs.
#pragma once
#include <cstdint>
#include <vector>

#include "algo/algo.h"

namespace plait {

// One piece of work: elements [offset, offset + count).
struct Span {
  int64_t offset = 0, count = 0;
};

// `count` elements cut into chunks of at most `chunk_elems` (>= 1); the last may be shorter.
// No chunks for count == 0.
std::vector<Span> chunk_plan(int64_t count, int64_t chunk_elems);

// Where part q of n parts of `count` elements begins, rounded up to a multiple of `align`
// elements (the parts stay contiguous and cover [0, count); a part may be empty), so that every
// part of a 16-byte-aligned vector starts 16-byte aligned and the kernels run vectorised.
int64_t aligned_part_begin(int64_t count, int n, int q, int64_t align);

// Ring neighbours and, per step, the block a rank sends and the block it receives.
// Reduce-scatter (n - 1 steps) leaves block r fully reduced on rank r: at step s rank r sends
// block (r - s - 1) mod n and receives block (r - s - 2) mod n. Allgather (n - 1 steps) starts
// from block r on rank r: at step s it sends block (r - s) mod n and receives (r - s - 1) mod n.
// The ring allreduce is reduce-scatter then allgather.
struct RingStep {
  int send_block, recv_block;
};
struct RingPlan {
  int left, right;
  std::vector<RingStep> reduce_scatter, allgather;
};
RingPlan ring_plan(int rank, int n);

// A ring over the CUDA IPC transport, as the steps one rank takes, in order. A rank passes data
// right by posting it in its own staging, which has two slots: the epoch e it posts (numbered
// from 1 within the call) fills slot e % 2, and the right neighbour reads it in its next step.
// allreduce (count: the vector): rounds of n * slot_elems elements, cut into n blocks
// (part_begin) of at most slot_elems; a round is ring_plan's reduce-scatter then allgather:
// 2 (n - 1) posts and as many reads of the left neighbour's.
// reduce_scatter (count: each block, the output): per window of slot_elems of every block,
// ring_plan's reduce-scatter; block r finished straight into the output: n - 1 posts.
// allgather (count: the input): per window, ring_plan's allgather: n - 1 posts; a rank's own
// block is the input, copied by the algorithm, not a step.
// Empty for n == 1 (the output is the input) and for count == 0.
struct IpcRingStep {
  enum Kind {
    load,    // slot(post) = in[in_offset]
    reduce,  // slot(post) = left's slot(read) op in[in_offset]
    finish,  // out[out_offset] = left's slot(read) op in[in_offset], finished (avg divides): block
             // r, computed once; through slot(post) first when post != 0
    gather,  // out[out_offset] = left's slot(read); then slot(post) = out[out_offset] unless post
             // == 0
  } kind;
  int block;           // the block, by ring_plan's numbering
  int64_t in_offset;   // elements into this rank's input (load, reduce, finish)
  int64_t out_offset;  // elements into its output (finish, gather)
  int64_t count;       // elements the step moves
  int64_t read = 0;    // the left neighbour's epoch this step reads (0: none)
  int64_t post = 0;    // the epoch this step posts (0: none)
};
std::vector<IpcRingStep> ipc_ring_plan(Coll coll, int rank, int n, int64_t count,
                                       int64_t slot_elems);

// A binary tree in heap order rooted at rank 0: parent (r - 1) / 2, children 2r + 1 and 2r + 2
// (those < n). Reduction flows to the root, which finishes the value and broadcasts it down.
struct TreeLinks {
  int parent = -1;            // -1 at the root
  std::vector<int> children;  // in the order their contributions are reduced
};
TreeLinks tree_links(int rank, int n);

}  // namespace plait
