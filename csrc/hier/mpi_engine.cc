// engine.h over MPI's C API. Every call starts nonblocking MPI (Iallreduce, Iallgather, Ibcast,
// Ialltoall, Isend/Irecv) on a private duplicate of the group's communicator and finishes it with
// an MPI_Testall loop: spin for 50 us (a small step between hosts takes tens of microseconds and
// MPI progresses only inside Test), yield up to 20 ms, then sleep in short steps, until the call's
// deadline. Every 50 ms of waiting (over all the process's groups) it also Improbes every
// group's second duplicate, the flag communicator.
//
// The flag is job-wide: fail() on any group marks every group of this process and sends (kind,
// world rank, message) once to every other member of every group (Isend, never waited); a rank
// that finds such a message marks all its groups. Marked groups fail their current and later
// calls with PEER_LOST "rank R failed: ...", R the failing process's MPI_COMM_WORLD rank
// (plait's rank under mpirun). The first failure a rank sees wins; it is not forwarded: the
// world group (every rank) carries it to everyone, and the others to their members.
//
// Threads: plait's progress thread makes the calls, fail() comes from any thread, and mpi4py
// may be used meanwhile: the engine needs MPI_THREAD_MULTIPLE (mpi4py's default).
//
// Counts: MPI counts are int, so a call moves at most `chunk` bytes (default 1 GiB) per MPI call
// and longer buffers take several. For allgather and alltoall a piece of every block travels as
// one block of a resized derived type whose extent is the whole block, so the layout holds.
//
// A call that gives up (deadline, flag) cancels its point-to-point requests; MPI cannot cancel a
// collective, so a collective that gives up is stranded and the group refuses later calls (its
// members are out of step; the communicator aborts after such an error anyway).
#include "hier/mpi_engine.h"

#include <sched.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bindings/capi.h"

namespace plait {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kFlagTag = 1;
constexpr auto kProbeEvery = std::chrono::milliseconds(50);
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kYield = std::chrono::milliseconds(20);
// Any piece below 2^31 bytes fits MPI's int counts; at 1 GiB a piece's fixed cost (microseconds)
// is lost in its transfer time (a tenth of a second or more).
constexpr size_t kDefaultChunk = size_t(1) << 30;
constexpr size_t kFlagText = 4000;  // the longest flag message sent

const char* dtype_name(uint8_t d) {
  static const char* names[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                "uint8",   "int32",    "int64",   "bool"};
  return d < sizeof(names) / sizeof(*names) ? names[d] : "?";
}
const char* op_name(uint8_t op) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg"};
  return op < sizeof(names) / sizeof(*names) ? names[op] : "?";
}

// MPI reduces these natively. bool is plait's logical type (sum/max = any, prod/min = all):
// exactly MPI's LOR/LAND on MPI_C_BOOL, which also gives 0/1 whatever nonzero byte came in.
// float16/bfloat16 are left to the communicator (allgather + plait's kernels): MPI has no such
// types, and plait rounds their reductions once from float32 the same way on every rank.
bool mpi_reduction(uint8_t dtype, uint8_t op, MPI_Datatype* type, MPI_Op* mop, size_t* size) {
  static_assert(sizeof(bool) == 1, "numpy bool is one byte");
  const MPI_Op arith[] = {MPI_SUM, MPI_PROD, MPI_MIN, MPI_MAX};
  if (op > PLAIT_MAX) return false;
  *mop = arith[op];
  switch (dtype) {
    case PLAIT_F32:
      *type = MPI_FLOAT, *size = 4;
      return true;
    case PLAIT_F64:
      *type = MPI_DOUBLE, *size = 8;
      return true;
    case PLAIT_I8:
      *type = MPI_INT8_T, *size = 1;
      return true;
    case PLAIT_U8:
      *type = MPI_UINT8_T, *size = 1;
      return true;
    case PLAIT_I32:
      *type = MPI_INT32_T, *size = 4;
      return true;
    case PLAIT_I64:
      *type = MPI_INT64_T, *size = 8;
      return true;
    case PLAIT_BOOL:
      *type = MPI_C_BOOL, *size = 1;
      *mop = op == PLAIT_SUM || op == PLAIT_MAX ? MPI_LOR : MPI_LAND;
      return true;
    default:
      return false;
  }
}

struct Engine {
  MPI_Comm data = MPI_COMM_NULL, flag = MPI_COMM_NULL;
  int rank = 0, size = 1, world_rank = -1, tag_ub = INT_MAX;
  std::string label;
  size_t chunk = kDefaultChunk;
  std::atomic<bool> flagged{false};
  std::mutex flag_mu;
  std::string flag_msg;  // set once, under flag_mu, before flagged
  std::vector<std::unique_ptr<std::vector<char>>> payloads;  // fail()'s messages in flight,
  std::vector<MPI_Request> fail_sends;                       // both under the registry's lock
  std::vector<MPI_Request> stranded;  // collectives of calls that gave up: MPI cannot cancel them
  std::string broken;                 // why the group refuses calls; empty while it does not
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
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: engines may be released during exit
  return *r;
}
int64_t ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// One call's requests (a batch of its pieces); a recv checks that its pieces had the bytes
// expected. moved: bytes of the call's earlier batches, already delivered.
struct Pending {
  std::vector<MPI_Request> reqs;
  bool p2p = false, recv = false;
  size_t bytes = 0, moved = 0;
};

uint32_t say(char* err, size_t errlen, uint32_t kind, const std::string& msg) {
  if (err && errlen) snprintf(err, errlen, "%s", msg.c_str());
  return kind;
}

std::string where(const Engine* e, const std::string& what) {
  return what + " on the mpi engine group " + e->label + " (rank " + std::to_string(e->rank) +
         " of " + std::to_string(e->size) + ")";
}

uint32_t mpi_error(const Engine* e, const std::string& what, int rc, char* err, size_t errlen) {
  char text[MPI_MAX_ERROR_STRING];
  int n = 0, cls = 0;
  MPI_Error_string(rc, text, &n);
  MPI_Error_class(rc, &cls);
  uint32_t kind = PLAIT_E_PEER_LOST;  // a broken connection or a process gone (ULFM) land here
  if (cls == MPI_ERR_TRUNCATE) kind = PLAIT_E_MISMATCH;
  if (cls == MPI_ERR_ARG || cls == MPI_ERR_COUNT || cls == MPI_ERR_TYPE || cls == MPI_ERR_TAG ||
      cls == MPI_ERR_RANK || cls == MPI_ERR_ROOT || cls == MPI_ERR_OP || cls == MPI_ERR_BUFFER)
    kind = PLAIT_E_INVALID;
  return say(err, errlen, kind, where(e, what) + ": MPI error: " + std::string(text, n));
}

bool set_flag(Engine* e, const std::string& msg) {
  std::lock_guard<std::mutex> g(e->flag_mu);
  if (e->flagged.load(std::memory_order_relaxed)) return false;  // the first failure wins
  e->flag_msg = msg;
  e->flagged.store(true, std::memory_order_release);
  return true;
}

// Another member's flag message on e's flag communicator, if one arrived ("" if none).
std::string take_flag(Engine* e) {
  int found = 0, n = 0;
  MPI_Message m;
  MPI_Status st;
  if (MPI_Improbe(MPI_ANY_SOURCE, kFlagTag, e->flag, &found, &m, &st) != MPI_SUCCESS || !found)
    return "";
  MPI_Get_count(&st, MPI_BYTE, &n);
  std::vector<char> buf(size_t(std::max(n, 0)));
  MPI_Mrecv(buf.data(), n, MPI_BYTE, &m, MPI_STATUS_IGNORE);
  int32_t who = st.MPI_SOURCE;
  std::string text = "(no message)";
  if (buf.size() >= 8) {
    memcpy(&who, buf.data() + 4, 4);
    text.assign(buf.data() + 8, buf.size() - 8);
  }
  return "rank " + std::to_string(who) + " failed: " + text;
}

// Looks for a flag message on every group's flag communicator, at most every kProbeEvery over
// all the process's waiting calls; the first found flags every group.
void probe(Clock::time_point now) {
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  if (ns(now) < r.next_probe.load(std::memory_order_relaxed)) return;
  r.next_probe.store(ns(now + kProbeEvery), std::memory_order_relaxed);
  std::string msg;
  for (Engine* e : r.engines)
    if (msg.empty()) msg = take_flag(e);
  if (!msg.empty())
    for (Engine* e : r.engines) set_flag(e, msg);
}

// Returns nonzero with the message when the group takes no calls.
uint32_t refused(Engine* e, char* err, size_t errlen) {
  if (e->flagged.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(e->flag_mu);
    return say(err, errlen, PLAIT_E_PEER_LOST, e->flag_msg);
  }
  if (!e->broken.empty()) return say(err, errlen, PLAIT_E_PEER_LOST, e->broken);
  return PLAIT_OK;
}

// Gives up on a call's requests. Returns true when all of them had finished normally after all.
// A point-to-point call whose message went only in part is cancelled but leaves the pair's
// later messages out of step, so it breaks the group too.
bool abandon(Engine* e, Pending& p, const std::string& what) {
  bool any_cancelled = false, any_moved = p.moved > 0, stranded = false;
  for (MPI_Request& r : p.reqs) {
    if (r == MPI_REQUEST_NULL) {
      any_moved = true;  // Testall freed it: that piece finished
      continue;
    }
    if (p.p2p) {
      MPI_Cancel(&r);
      MPI_Status st;
      int done = 0, cancelled = 0;
      for (int i = 0; i < 1000 && !done; ++i) MPI_Test(&r, &done, &st);
      if (done) MPI_Test_cancelled(&st, &cancelled);
      if (done) {
        (cancelled ? any_cancelled : any_moved) = true;
        continue;
      }
    }
    stranded = true;
    e->stranded.push_back(r);
    r = MPI_REQUEST_NULL;
  }
  if ((stranded || (any_cancelled && any_moved)) && e->broken.empty())
    e->broken = where(e, what) +
                " gave up part way and MPI cannot undo that: the group's members are out of step "
                "and it takes no more calls";
  return !stranded && !any_cancelled;
}

// Finishes a call's requests (see the top of the file). `what` names the call in messages.
Clock::time_point deadline_of(double timeout_s) {
  if (!(timeout_s < 1e9)) return Clock::time_point::max();  // NaN and inf: no deadline
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::max(timeout_s, 0.0)));
}

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
    if (waited < kYield)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(waited < kProbeEvery * 4 ? 100 : 1000));
  }
  if (p.recv) {
    size_t got = 0;
    for (MPI_Status& s : st) {
      int n = 0;
      MPI_Get_count(&s, MPI_BYTE, &n);
      got += size_t(std::max(n, 0));
    }
    if (got != p.bytes)
      return say(err, errlen, PLAIT_E_MISMATCH,
                 where(e, what()) + ": the message had " + std::to_string(got) + " bytes");
  }
  return PLAIT_OK;
}

// The most bytes one MPI call moves: a whole number of units, at least one, below 2^31.
size_t piece(const Engine* e, size_t unit) {
  return std::max<size_t>(1, std::min<size_t>(e->chunk, INT_MAX) / unit) * unit;
}

// A block of len bytes whose extent is stride bytes: one piece of each member's block.
int strided(size_t len, size_t stride, MPI_Datatype* out) {
  MPI_Datatype blk;
  int rc = MPI_Type_contiguous(int(len), MPI_BYTE, &blk);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Type_create_resized(blk, 0, MPI_Aint(stride), out);
  MPI_Type_free(&blk);
  if (rc == MPI_SUCCESS) rc = MPI_Type_commit(out);
  return rc;
}

// Posts a call's pieces with post(off, len, &request) under the MPI lock and finishes them, at
// most two at a time: Open MPI's Iallreduce allocates a temporary buffer per piece, so a buffer
// of many GiB costs two pieces' worth, not its own size again; two keep the link busy while one
// completes.
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
    {
      do {
        const size_t len = std::min(step, bytes - off);
        MPI_Request r = MPI_REQUEST_NULL;
        rc = post(off, len, &r);
        if (rc != MPI_SUCCESS) break;
        p.reqs.push_back(r);
        off += len;
        p.bytes += len;
      } while (off < bytes && p.reqs.size() < 2);
    }
    if (rc != MPI_SUCCESS) {
      abandon(e, p, what());
      return mpi_error(e, what(), rc, err, errlen);
    }
    if (uint32_t k = finish(e, p, deadline, timeout_s, what, err, errlen)) return k;
  } while (off < bytes);
  return PLAIT_OK;
}

std::string nbytes(size_t b) { return std::to_string(b) + " bytes"; }

int supports(void*, uint8_t dtype, uint8_t op) {
  MPI_Datatype t;
  MPI_Op o;
  size_t s;
  return mpi_reduction(dtype, op, &t, &o, &s) ? 1 : 0;
}

uint32_t allreduce(void* ctx, void* buf, size_t count, uint8_t dtype, uint8_t op, double timeout_s,
                   char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  auto what = [&] {
    return "allreduce of " + std::to_string(count) + " " + dtype_name(dtype) + " (" + op_name(op) +
           ")";
  };
  MPI_Datatype type;
  MPI_Op mop;
  size_t es;
  if (!mpi_reduction(dtype, op, &type, &mop, &es))
    return say(err, errlen, PLAIT_E_INVALID,
               where(e, what()) + ": MPI does not reduce this dtype and op (ask supports())");
  if (e->size == 1 || count == 0) return refused(e, err, errlen);
  Pending p;
  char* b = static_cast<char*>(buf);
  return run(
      e, p, count * es, es, timeout_s, what,
      [&](size_t off, size_t len, MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, b + off, int(len / es), type, mop, e->data, r);
      },
      err, errlen);
}

uint32_t allgather_start(void* ctx, const void* in, void* out, size_t bytes, void** req, char* err,
                         size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  *req = nullptr;
  auto what = [&] { return "allgather of " + nbytes(bytes); };
  if (uint32_t k = refused(e, err, errlen)) return k;
  auto p = std::make_unique<Pending>();
  p->bytes = bytes;
  if (e->size == 1 || bytes == 0) {
    if (bytes) memcpy(out, in, bytes);
    *req = p.release();
    return PLAIT_OK;
  }
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  int rc = MPI_SUCCESS;
  {
    const size_t step = piece(e, 1);
    for (size_t off = 0; off < bytes && rc == MPI_SUCCESS; off += step) {
      const size_t len = std::min(step, bytes - off);
      MPI_Request r = MPI_REQUEST_NULL;
      if (len == bytes) {
        rc = MPI_Iallgather(i, int(len), MPI_BYTE, o, int(len), MPI_BYTE, e->data, &r);
      } else {  // every member's piece lands at its own block's offset off
        MPI_Datatype t;
        rc = strided(len, bytes, &t);
        if (rc != MPI_SUCCESS) break;
        rc = MPI_Iallgather(i + off, int(len), MPI_BYTE, o + off, 1, t, e->data, &r);
        MPI_Type_free(&t);
      }
      if (rc == MPI_SUCCESS) p->reqs.push_back(r);
    }
  }
  if (rc != MPI_SUCCESS) {
    abandon(e, *p, what());
    return mpi_error(e, what(), rc, err, errlen);
  }
  *req = p.release();
  return PLAIT_OK;
}

uint32_t wait(void* ctx, void* req, double timeout_s, char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  std::unique_ptr<Pending> p(static_cast<Pending*>(req));
  if (!p) return PLAIT_OK;
  auto what = [&] { return "allgather of " + nbytes(p->bytes); };
  return finish(e, *p, deadline_of(timeout_s), timeout_s, what, err, errlen);
}

uint32_t allgather(void* ctx, const void* in, void* out, size_t bytes, double timeout_s, char* err,
                   size_t errlen) {
  void* req = nullptr;
  if (uint32_t k = allgather_start(ctx, in, out, bytes, &req, err, errlen)) return k;
  return wait(ctx, req, timeout_s, err, errlen);
}

uint32_t broadcast(void* ctx, void* buf, size_t bytes, int root, double timeout_s, char* err,
                   size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  auto what = [&] {
    return "broadcast of " + nbytes(bytes) + " from root " + std::to_string(root);
  };
  if (root < 0 || root >= e->size)
    return say(err, errlen, PLAIT_E_INVALID, where(e, what()) + ": no such member");
  if (e->size == 1 || bytes == 0) return refused(e, err, errlen);
  Pending p;
  char* b = static_cast<char*>(buf);
  return run(
      e, p, bytes, 1, timeout_s, what,
      [&](size_t off, size_t len, MPI_Request* r) {
        return MPI_Ibcast(b + off, int(len), MPI_BYTE, root, e->data, r);
      },
      err, errlen);
}

uint32_t alltoall(void* ctx, const void* in, void* out, size_t bytes, double timeout_s, char* err,
                  size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  auto what = [&] { return "alltoall of " + nbytes(bytes) + " per member"; };
  if (e->size == 1 || bytes == 0) {
    if (bytes) memcpy(out, in, bytes);
    return refused(e, err, errlen);
  }
  Pending p;
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  return run(
      e, p, bytes, 1, timeout_s, what,
      [&](size_t off, size_t len, MPI_Request* r) {
        if (len == bytes)
          return MPI_Ialltoall(i, int(len), MPI_BYTE, o, int(len), MPI_BYTE, e->data, r);
        MPI_Datatype t;
        int rc = strided(len, bytes, &t);
        if (rc != MPI_SUCCESS) return rc;
        rc = MPI_Ialltoall(i + off, 1, t, o + off, 1, t, e->data, r);
        MPI_Type_free(&t);
        return rc;
      },
      err, errlen);
}

uint32_t p2p(Engine* e, bool is_send, void* buf, size_t bytes, int peer, int tag, double timeout_s,
             char* err, size_t errlen) {
  auto what = [&] {
    return std::string(is_send ? "send of " : "recv of ") + nbytes(bytes) +
           (is_send ? " to peer " : " from peer ") + std::to_string(peer) + " tag " +
           std::to_string(tag);
  };
  if (peer < 0 || peer >= e->size || peer == e->rank)
    return say(err, errlen, PLAIT_E_INVALID,
               where(e, what()) + ": the peer must be another member");
  if (tag < 0 || tag > e->tag_ub)
    return say(err, errlen, PLAIT_E_INVALID,
               where(e, what()) + ": tags go from 0 to " + std::to_string(e->tag_ub));
  Pending p;
  p.p2p = true;
  p.recv = !is_send;
  char* b = static_cast<char*>(buf);
  return run(
      e, p, bytes, 1, timeout_s, what,
      [&](size_t off, size_t len, MPI_Request* r) {
        return is_send ? MPI_Isend(b + off, int(len), MPI_BYTE, peer, tag, e->data, r)
                       : MPI_Irecv(b + off, int(len), MPI_BYTE, peer, tag, e->data, r);
      },
      err, errlen);
}

uint32_t send(void* ctx, const void* buf, size_t bytes, int peer, int tag, double timeout_s,
              char* err, size_t errlen) {
  return p2p(static_cast<Engine*>(ctx), true, const_cast<void*>(buf), bytes, peer, tag, timeout_s,
             err, errlen);
}

uint32_t recv(void* ctx, void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
              size_t errlen) {
  return p2p(static_cast<Engine*>(ctx), false, buf, bytes, peer, tag, timeout_s, err, errlen);
}

void fail(void* ctx, uint32_t kind, const char* msg) {
  Engine* me = static_cast<Engine*>(ctx);
  std::string text = msg ? msg : "";
  if (text.size() > kFlagText) text.resize(kFlagText);
  const std::string flag = "rank " + std::to_string(me->world_rank) + " failed: " + text;
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  if (!set_flag(me, flag)) return;  // a failure is already known here: the first one stands
  for (Engine* e : r.engines) set_flag(e, flag);
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  int32_t who = me->world_rank;
  for (Engine* e : r.engines) {
    if (e->size == 1) continue;
    auto payload = std::make_unique<std::vector<char>>(8 + text.size());
    memcpy(payload->data(), &kind, 4);
    memcpy(payload->data() + 4, &who, 4);
    memcpy(payload->data() + 8, text.data(), text.size());
    for (int peer = 0; peer < e->size; ++peer) {
      if (peer == e->rank) continue;
      MPI_Request req = MPI_REQUEST_NULL;
      if (MPI_Isend(payload->data(), int(payload->size()), MPI_BYTE, peer, kFlagTag, e->flag,
                    &req) == MPI_SUCCESS)
        e->fail_sends.push_back(req);
    }
    e->payloads.push_back(std::move(payload));
  }
}

void release(void* ctx) {
  std::unique_ptr<Engine> e(static_cast<Engine*>(ctx));
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.engines.erase(std::remove(r.engines.begin(), r.engines.end(), e.get()), r.engines.end());
  int finalized = 1;
  MPI_Finalized(&finalized);
  if (finalized) return;
  bool sent = true;
  for (MPI_Request& req : e->fail_sends) {
    int done = 0;
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) {
      MPI_Request_free(&req);  // the send goes on; its bytes must outlive it
      sent = false;
    }
  }
  if (!sent)
    for (auto& p : e->payloads) p.release();
  // The stranded collectives stay with MPI (it may still write their buffers; the caller was told
  // the group broke). Freeing a communicator with operations pending is allowed: MPI deallocates
  // it when they end.
  MPI_Comm_free(&e->data);
  MPI_Comm_free(&e->flag);
}

}  // namespace

plait_engine* mpi_engine_create(MPI_Comm comm, const char* label, size_t chunk_bytes, char* err,
                                size_t errlen) {
  int init = 0, finalized = 0, level = 0, inter = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&finalized);
  if (!init || finalized) {
    say(err, errlen, PLAIT_E_INVALID,
        std::string("the MPI engine needs MPI initialised (import mpi4py.MPI) and not yet ") +
            "finalised");
    return nullptr;
  }
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE) {
    say(err, errlen, PLAIT_E_INVALID,
        "MPI was initialised below MPI_THREAD_MULTIPLE; plait calls MPI from its progress thread "
        "and fail() from any thread: leave mpi4py.rc.thread_level at 'multiple' (its default)");
    return nullptr;
  }
  if (comm == MPI_COMM_NULL || MPI_Comm_test_inter(comm, &inter) != MPI_SUCCESS || inter) {
    say(err, errlen, PLAIT_E_INVALID,
        "the MPI engine needs an intracommunicator (got MPI_COMM_NULL or an intercommunicator)");
    return nullptr;
  }
  auto e = std::make_unique<Engine>();
  e->label = label ? label : "?";
  if (chunk_bytes) e->chunk = std::min<size_t>(chunk_bytes, INT_MAX);
  int rc = MPI_Comm_dup(comm, &e->data);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_dup(comm, &e->flag);
  if (rc != MPI_SUCCESS) {
    mpi_error(e.get(), "duplicating the communicator", rc, err, errlen);
    if (e->data != MPI_COMM_NULL) MPI_Comm_free(&e->data);
    return nullptr;
  }
  MPI_Comm_set_errhandler(e->data, MPI_ERRORS_RETURN);
  MPI_Comm_set_errhandler(e->flag, MPI_ERRORS_RETURN);
  MPI_Comm_rank(e->data, &e->rank);
  MPI_Comm_size(e->data, &e->size);
  MPI_Comm_rank(MPI_COMM_WORLD, &e->world_rank);
  int* ub = nullptr;
  int has = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &has);
  if (has && ub) e->tag_ub = *ub;
  plait_engine& t = e->table;
  t.version = PLAIT_ENGINE_VERSION;
  t.struct_size = sizeof(plait_engine);
  t.name = "mpi";
  t.rank = e->rank;
  t.size = e->size;
  t.ctx = e.get();
  t.supports = supports;
  t.allreduce = allreduce;
  t.allgather = allgather;
  t.allgather_start = allgather_start;
  t.wait = wait;
  t.broadcast = broadcast;
  t.alltoall = alltoall;
  t.send = send;
  t.recv = recv;
  t.fail = fail;
  t.release = release;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> g(r.mu);
    r.engines.push_back(e.get());
  }
  return &e.release()->table;
}

}  // namespace plait
