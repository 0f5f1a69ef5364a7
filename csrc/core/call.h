// One call's arguments, as the communicator checks them and an algorithm runs them.
#pragma once
#include <cstdint>

#include "core/types.h"

namespace plait {

// One call as every rank must agree on it. count is in elements: the whole vector for allreduce
// and broadcast/reduce, one rank's block for reduce_scatter (output), allgather (input) and
// alltoall (per peer).
struct CallArgs {
  Coll coll = Coll::barrier;
  DType dtype = DType::f32;
  RedOp op = RedOp::sum;
  int root = 0;
  int peer = -1;
  int64_t tag = 0;
  int64_t count = 0;
  const void* in = nullptr;
  void* out = nullptr;
  int algo = -1;  // index among the collective's rows its transport offers (algo/algo.h); -1 = auto
  double timeout_s = 0;  // >= 0 (0: a wait fails unless its peer is there; inf: no deadline)
};

}  // namespace plait
