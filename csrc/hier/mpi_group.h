// The MPI engine's groups and the wait every call ends in (see mpi_engine.cc, the engine.h
// table over them, for how calls, the job-wide flag and pieces work). Shared by mpi_group.cc
// (the non-template parts) and mpi_engine.cc.
#ifndef PLAIT_HIER_MPI_GROUP_H
#define PLAIT_HIER_MPI_GROUP_H
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bindings/capi.h"
#include "hier/mpi_engine.h"

namespace plait {
namespace mpi {

using Clock = std::chrono::steady_clock;
inline constexpr int kFlagTag = 1;
inline constexpr auto kProbeEvery = std::chrono::milliseconds(50);
inline constexpr auto kSpin = std::chrono::microseconds(50);
inline constexpr auto kYield = std::chrono::milliseconds(20);
// Any piece below 2^31 bytes fits MPI's int counts; at 1 GiB a piece's fixed cost (microseconds)
// is lost in its transfer time (a tenth of a second or more).
inline constexpr size_t kDefaultChunk = size_t(1) << 30;
inline constexpr size_t kFlagText = 4000;  // the longest flag message sent

struct Transfer;  // a p2p_start request (below)

struct Engine {
  MPI_Comm data = MPI_COMM_NULL, flag = MPI_COMM_NULL;
  int rank = 0, size = 1, world_rank = -1, tag_ub = INT_MAX;
  std::string label;
  size_t chunk = kDefaultChunk;
  std::atomic<bool> flagged{false};
  std::mutex flag_mu;
  std::string flag_msg;                    // set once, under flag_mu, before flagged
  uint32_t flag_kind = PLAIT_E_PEER_LOST;  // what flagged calls fail with (with flag_msg)
  std::vector<std::unique_ptr<std::vector<char>>> payloads;  // fail()'s messages in flight,
  std::vector<MPI_Request> fail_sends;                       // both under the registry's lock
  std::vector<MPI_Request> stranded;  // collectives of calls that gave up: MPI cannot cancel them
  std::string broken;                 // why the group refuses calls; empty while it does not
  std::list<Transfer*> transfers;     // p2p_start's requests not yet handed back, in start order
  std::mutex calls;  // held by the p2p calls, so other groups' waits may claim recvs' messages
  plait_engine table{};
};

// Every engine group of this process. The flag is job-wide: a failure made (fail()) or found
// (a flag message on any group's flag communicator) ends the calls of every group here, and
// fail() tells the members of every group, so a rank waiting in a group the failing rank is not
// in (a shard group of another host pair) hears of it too, through the world group.
struct Registry {
  std::mutex mu;
  std::vector<Engine*> engines;
  std::atomic<int64_t> next_probe{0};  // steady-clock ns: when a waiting call next probes
  std::atomic<int> recvs{0};           // p2p recvs not yet handed back, over every group
};
Registry& registry();
inline int64_t ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// One call's requests (a batch of its pieces). moved: bytes of the call's earlier batches,
// already delivered. recv: a p2p_start recv's (Transfer).
struct Pending {
  std::vector<MPI_Request> reqs;
  bool p2p = false, recv = false;
  size_t bytes = 0, moved = 0;
  std::string what;  // a started request's call, for wait's messages
};

// A p2p_start request, cut into pieces as send() cuts a message. A send posts every piece at
// start. A recv posts nothing: its pieces claim their messages in order (MPI_Improbe, then
// MPI_Imrecv) as p2p_test and probe find them, after every earlier recv of the same (peer, tag),
// so the size of each message is known before any byte lands and a longer message is drained
// aside, never truncated (Open MPI 4.1 writes a truncated message of more than its eager size
// past the receive buffer, over shared memory and tcp alike). p2p_test takes the pieces as they
// finish (Testsome). `over` once it finished or gave up; then outcome and msg are its result.
struct Transfer {
  Pending p;                 // reqs[i]: MPI_REQUEST_NULL before piece i is posted and once done
  std::vector<size_t> lens;  // each piece's bytes
  std::vector<int> idx;      // Testsome's scratch, one per piece (p2p_test allocates nothing)
  std::vector<MPI_Status> st;
  char* base = nullptr;            // the caller's buffer
  size_t matched = 0, wanted = 0;  // a recv's pieces [matched, wanted) have no message yet
  std::vector<char> aside;         // a longer message than its piece, received to be dropped
  size_t got = 0, left = 0;        // bytes the finished pieces brought; pieces not finished
  int peer = 0, tag = 0;
  Clock::time_point deadline;
  double timeout_s = 0;
  bool over = false;
  uint32_t outcome = PLAIT_OK;
  std::string msg;
  std::list<Transfer*>::iterator at;  // its place in Engine::transfers
};
// Gives the messages that have arrived to the recvs of t's (peer, tag) started up to t, in
// start order (never waits).
void claim_upto(Engine* e, Transfer& t);
// True when a recv of (src, tag) started earlier is waiting for a message (probe's message then
// belongs to it); it claims what has come.
bool awaited(Engine* e, int src, int tag);
// Claims the messages that have come for the recvs in flight of every group whose calls are not
// running now: a blocking wait on one group must not keep another's sender waiting for it (as
// MPI progresses posted receives in any call).
void claim_everywhere();
// Moves t on without waiting: claims and takes its pieces, and gives up on the rest on an MPI
// error, the flag or the deadline; t.over once it has a result.
void advance(Engine* e, Transfer& t);
// Gives up on t's pieces in flight (a release with t unfinished): t.over, with kind and msg.
void give_up(Engine* e, Transfer& t, uint32_t kind, const std::string& msg);

const char* dtype_name(uint8_t d);
const char* op_name(uint8_t op);
// The MPI type and op of a (plait dtype, op) MPI reduces natively; false for the others.
bool mpi_reduction(uint8_t dtype, uint8_t op, MPI_Datatype* type, MPI_Op* mop, size_t* size);
uint32_t say(char* err, size_t errlen, uint32_t kind, const std::string& msg);
std::string where(const Engine* e, const std::string& what);
uint32_t mpi_error(const Engine* e, const std::string& what, int rc, char* err, size_t errlen);
// Marks e with a failure (of kind, as fail() got it); false when it already had one (the first
// stands). Flagged calls fail with that kind.
bool set_flag(Engine* e, uint32_t kind, const std::string& msg);
// Looks for flag messages on every group (at most every kProbeEvery over the process).
void probe(Clock::time_point now);
// Nonzero, with the message, when e takes no calls (flagged, or broken).
uint32_t refused(Engine* e, char* err, size_t errlen);
// Gives up on p's requests; true when all of them had finished normally after all.
bool abandon(Engine* e, Pending& p, const std::string& what);
Clock::time_point deadline_of(double timeout_s);
// The most bytes one MPI call moves: a whole number of units, at least one, below 2^31.
size_t piece(const Engine* e, size_t unit);
// A block of len bytes whose extent is stride bytes: one piece of each member's block.
int strided(size_t len, size_t stride, MPI_Datatype* out);

// Finishes a call's requests: Testall, spinning, then yielding, then sleeping, with the deadline
// and the flag. `what` names the call in messages (built only for them).
template <class What>
uint32_t finish(Engine* e, Pending& p, Clock::time_point deadline, double timeout_s,
                const What& what, char* err, size_t errlen) {
  if (p.reqs.empty()) return PLAIT_OK;
  const Clock::time_point start = Clock::now();
  std::vector<MPI_Status> st(p.reqs.size());
  for (;;) {
    int done = 0, rc;
    { rc = MPI_Testall(int(p.reqs.size()), p.reqs.data(), &done, st.data()); }
    if (rc == MPI_ERR_IN_STATUS) {  // the first request that failed says why; those done are gone
      for (size_t i = 0; i < st.size(); ++i) {
        if (st[i].MPI_ERROR == MPI_ERR_PENDING) continue;
        if (st[i].MPI_ERROR != MPI_SUCCESS && rc == MPI_ERR_IN_STATUS) rc = st[i].MPI_ERROR;
        p.reqs[i] = MPI_REQUEST_NULL;
      }
    }
    if (rc != MPI_SUCCESS) {
      abandon(e, p, what());
      return mpi_error(e, what(), rc, err, errlen);
    }
    if (done) break;
    if (e->flagged.load(std::memory_order_acquire)) {
      abandon(e, p, what());
      return refused(e, err, errlen);
    }
    const Clock::time_point now = Clock::now();
    if (ns(now) >= registry().next_probe.load(std::memory_order_relaxed)) {
      probe(now);
      continue;
    }
    if (now >= deadline) {
      if (abandon(e, p, what())) break;
      char secs[32];
      snprintf(secs, sizeof secs, "%.3g", timeout_s);
      return say(
          err, errlen, PLAIT_E_TIMEOUT,
          where(e, what()) + ": deadline (" + secs + " s) passed waiting for the other members");
    }
    const auto waited = now - start;
    if (waited < kSpin) continue;
    claim_everywhere();  // past the spin: a short wait needs no other group's recvs
    if (waited < kYield)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(waited < kProbeEvery * 4 ? 100 : 1000));
  }
  return PLAIT_OK;
}

// Posts a call's pieces with post(off, len, &request) and finishes them, at most two at a time:
// Open MPI's Iallreduce allocates a temporary buffer per piece, so a buffer of many GiB costs two
// pieces' worth, not its own size again; two keep the link busy while one completes.
template <class What, class Post>
uint32_t run(Engine* e, Pending& p, size_t bytes, size_t unit, double timeout_s, const What& what,
             Post&& post, char* err, size_t errlen) {
  if (uint32_t k = refused(e, err, errlen)) return k;
  const Clock::time_point deadline = deadline_of(timeout_s);
  const size_t step = piece(e, unit);
  size_t off = 0;
  do {
    int rc = MPI_SUCCESS;
    p.reqs.clear();
    p.moved = off;
    p.bytes = 0;
    do {
      const size_t len = std::min(step, bytes - off);
      MPI_Request r = MPI_REQUEST_NULL;
      rc = post(off, len, &r);
      if (rc != MPI_SUCCESS) break;
      p.reqs.push_back(r);
      off += len;
      p.bytes += len;
    } while (off < bytes && p.reqs.size() < 2);
    if (rc != MPI_SUCCESS) {
      abandon(e, p, what());
      return mpi_error(e, what(), rc, err, errlen);
    }
    if (uint32_t k = finish(e, p, deadline, timeout_s, what, err, errlen)) return k;
  } while (off < bytes);
  return PLAIT_OK;
}

}  // namespace mpi
}  // namespace plait
#endif
