// Host-side planning for the GPU algorithms: plain C++ with no CUDA, compiled into every build so
// the CPU tests check it (plait._C.gpu_plan_*). The GPU algorithms execute exactly these plans.
#pragma once
#include <cstdint>
#include <vector>

namespace plait {

// One piece of work: elements [offset, offset + count).
struct Span {
  int64_t offset = 0, count = 0;
};

// `count` elements cut into chunks of at most `chunk_elems` (>= 1); the last may be shorter.
// No chunks for count == 0.
std::vector<Span> chunk_plan(int64_t count, int64_t chunk_elems);

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

// A binary tree in heap order rooted at rank 0: parent (r - 1) / 2, children 2r + 1 and 2r + 2
// (those < n). Reduction flows to the root, which finishes the value and broadcasts it down.
struct TreeLinks {
  int parent = -1;           // -1 at the root
  std::vector<int> children;  // in the order their contributions are reduced
};
TreeLinks tree_links(int rank, int n);

}  // namespace plait
