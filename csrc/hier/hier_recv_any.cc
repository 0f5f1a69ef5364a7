// A receive from any rank on the multi-host communicator (hier/hier_comm.h).
//
// Nothing is posted before the sender is known, so two candidates (one on this host, one on
// another) can never both be consumed: each round asks this host's communicator
// (Communicator::ready_source: its channels and its stash, as its own any-source recv looks at
// them) and the world engine (engine.h's probe) whether a message of the tag is ready,
// alternating which is asked first so that a busy side cannot starve the other; the first sender
// found is then received from by name, which takes exactly that message and keeps each
// (sender, tag) pair's order. The call is one task on the progress thread like every other, so a
// later named recv cannot take a message this one matched, nor the other way round. Idle rounds
// back off as plait's waits do (core/wait.h): spin a little, yield, then nap up to 200 us.
#include <cstdio>
#include <string>

#include "core/wait.h"
#include "hier/hier_comm.h"

namespace plait {

void HierComm::recv_any(const CallArgs& a, double deadline) {
  const size_t bytes = size_t(a.count) * dtype_size(a.dtype);
  const std::vector<int>& mine = lay_.hosts[size_t(lay_.h)];
  auto what = [&] {
    return "rank " + std::to_string(rank_) + ": recv from any rank (tag=" + std::to_string(a.tag) +
           ", " + std::to_string(bytes) + " bytes, " + dtype_name(a.dtype) + ")";
  };
  WaitPolicy policy;
  policy.spin_iters = 64;  // a round is two probes (locks, an MPI_Iprobe), not one load
  Backoff backoff(policy);
  const double start = now_s();
  double next_health = start + 0.05;
  bool local_first = true;
  for (;;) {
    int src = -1;
    size_t sent = PLAIT_ENGINE_UNKNOWN;
    for (int k = 0; k < 2 && src < 0; ++k) {
      if ((k == 0) == local_first) {
        if (mine.size() < 2) continue;
        int lp = -1;
        try {
          lp = local_->ready_source(a.tag);
        } catch (const PlaitError& e) {
          throw_error(e.kind(), what() + " on host " + std::to_string(lay_.h) + ": " + e.what() +
                                    " [" + lay_.describe_host(lay_.h) + "]");
        }
        if (lp >= 0) src = mine[size_t(lp)];
      } else {
        size_t b = 0;
        const int s = world_->probe(int(a.tag), &b);
        if (s >= 0) src = s, sent = b;
      }
    }
    local_first = !local_first;
    if (src >= 0) {
      if (sent != PLAIT_ENGINE_UNKNOWN && sent != bytes)
        throw MismatchError("mismatched send/recv: " + what() + " matched a message of rank " +
                            std::to_string(src) + " on host " +
                            std::to_string(lay_.host_of[size_t(src)]) + " of " +
                            std::to_string(sent) + " bytes");
      if (Task* t = Communicator::running_task()) t->args.peer = src;  // the task's source
      CallArgs named = a;
      named.peer = src;
      p2p(named, deadline);
      return;
    }
    backoff.idle([&](double t) {
      if (t >= next_health) {  // a dead rank of this host (the engine's probe sees other hosts')
        next_health = t + 0.05;
        if (mine.size() > 1) {
          const std::string dead = local_->dead_peer();
          if (!dead.empty())
            throw PeerLostError(what() + " on host " + std::to_string(lay_.h) + ": " + dead + " [" +
                                lay_.describe_host(lay_.h) + "]");
        }
      }
      if (t < deadline) return;
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.3g", t - start);
      throw TimeoutError(what() + ": deadline passed (" + secs +
                         " s) with no message of this tag from any of the " +
                         std::to_string(size_ - 1) + " other ranks (" +
                         std::to_string(lay_.nhosts()) + " hosts, " + world_->engine() +
                         " between them)");
    });
  }
}

}  // namespace plait
