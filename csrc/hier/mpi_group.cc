// The MPI engine's groups (mpi_group.h): messages, the job-wide flag's registry and probe, and
// giving up on a call's requests.
#include "hier/mpi_group.h"

#include <stdio.h>
#include <string.h>

namespace plait {
namespace mpi {

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

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: engines may be released during exit
  return *r;
}

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

// The kind fail() recorded (engine.h): bad input or a mismatch on one host raises the same class
// on every host. An unknown code (a newer sender) reads as a lost peer.
static uint32_t flag_kind(uint32_t kind) {
  return kind >= PLAIT_E_GENERIC && kind <= PLAIT_E_PEER_LOST ? kind : PLAIT_E_PEER_LOST;
}

bool set_flag(Engine* e, uint32_t kind, const std::string& msg) {
  std::lock_guard<std::mutex> g(e->flag_mu);
  if (e->flagged.load(std::memory_order_relaxed)) return false;  // the first failure wins
  e->flag_kind = flag_kind(kind);
  e->flag_msg = msg;
  e->flagged.store(true, std::memory_order_release);
  return true;
}

// Another member's flag message on e's flag communicator, if one arrived: its kind and "rank R
// failed: ..." ("" if none).
static std::string take_flag(Engine* e, uint32_t* kind) {
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
  *kind = PLAIT_E_PEER_LOST;
  if (buf.size() >= 8) {
    memcpy(kind, buf.data(), 4);
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
  uint32_t kind = PLAIT_E_PEER_LOST;
  for (Engine* e : r.engines)
    if (msg.empty()) msg = take_flag(e, &kind);
  if (!msg.empty())
    for (Engine* e : r.engines) set_flag(e, kind, msg);
}

// Returns nonzero with the message when the group takes no calls.
uint32_t refused(Engine* e, char* err, size_t errlen) {
  if (e->flagged.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> g(e->flag_mu);
    return say(err, errlen, e->flag_kind, e->flag_msg);
  }
  if (!e->broken.empty()) return say(err, errlen, PLAIT_E_PEER_LOST, e->broken);
  return PLAIT_OK;
}

static void break_group(Engine* e, const std::string& what) {
  if (e->broken.empty())
    e->broken = where(e, what) +
                " gave up part way and MPI cannot undo that: the group's members are out of step "
                "and it takes no more calls";
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
  if (stranded || (any_cancelled && any_moved)) break_group(e, what);
  return !stranded && !any_cancelled;
}

Clock::time_point deadline_of(double timeout_s) {
  if (!(timeout_s < 1e9)) return Clock::time_point::max();  // NaN and inf: no deadline
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(std::max(timeout_s, 0.0)));
}

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

// p2p_start's transfers (mpi_engine.cc has the calls). Piece i of a transfer finished: for a
// recv, its bytes count and must fill the piece (only the last piece of a message may be short
// of a chunk, and only the sender's last piece is ever short).
static void took(Engine* e, Transfer& t, size_t i, MPI_Status& st, int error) {
  --t.left;
  int n = 0;
  if (t.p.recv) MPI_Get_count(&st, MPI_BYTE, &n);
  const size_t got = size_t(std::max(n, 0)), before = i * t.lens[0];
  if (t.outcome) return;  // the first problem found stands
  int cls = MPI_SUCCESS;
  if (error != MPI_SUCCESS) MPI_Error_class(error, &cls);
  if (cls == MPI_ERR_TRUNCATE) {
    // Open MPI counts the whole incoming piece here; an MPI that counts only what fit tells
    // nothing. A whole piece may have more of the sender's behind it, which would meet the
    // pair's next recv: the group is then out of step.
    const bool known = got > t.lens[i], whole = got >= piece(e, 1);
    t.out_of_step = !known || whole;
    const std::string had = !known  ? "was longer"
                            : whole ? "had at least " + std::to_string(before + got) + " bytes"
                                    : "had " + std::to_string(before + got) + " bytes";
    t.outcome = PLAIT_E_MISMATCH;
    t.msg = where(e, t.p.what) + ": the message " + had + " (more than the " +
            std::to_string(t.p.bytes) + " asked)";
  } else if (error != MPI_SUCCESS) {
    char msg[1024];
    t.outcome = mpi_error(e, t.p.what, error, msg, sizeof msg);
    t.msg = msg;
  } else if (t.p.recv && got < t.lens[i]) {
    t.outcome = PLAIT_E_MISMATCH;
    t.msg = where(e, t.p.what) + ": the message had " + std::to_string(before + got) + " bytes";
  } else {
    t.got += got;
  }
}

// Cancels t's pieces in flight. A piece that finishes meanwhile is taken; one MPI neither
// cancels nor finishes (a send whose receiver is under way, or Open MPI's ob1, which cancels no
// send) is freed and left to MPI: it completes or dies with the job, and the group is broken.
namespace {
struct Dropped {
  int cancelled = 0, completed = 0, stranded = 0;
};
}  // namespace
static Dropped cancel_rest(Engine* e, Transfer& t) {
  Dropped d;
  for (size_t i = 0; i < t.p.reqs.size(); ++i) {
    MPI_Request& r = t.p.reqs[i];
    if (r == MPI_REQUEST_NULL) continue;
    MPI_Cancel(&r);
    MPI_Status st;
    int done = 0, cancelled = 0;
    for (int k = 0; k < 1000 && !done; ++k) MPI_Test(&r, &done, &st);
    if (!done) {
      MPI_Request_free(&r);
      ++d.stranded;
      continue;
    }
    MPI_Test_cancelled(&st, &cancelled);
    if (cancelled) {
      ++d.cancelled;
      --t.left;
    } else {
      ++d.completed;
      took(e, t, i, st, MPI_SUCCESS);
    }
    r = MPI_REQUEST_NULL;
  }
  return d;
}

void give_up(Engine* e, Transfer& t, uint32_t kind, const std::string& msg) {
  const bool moved_before = t.left < t.lens.size();
  const Dropped d = cancel_rest(e, t);
  t.over = true;
  if (!d.cancelled && !d.stranded && !t.outcome) return;  // it finished after all
  if (d.stranded || (d.cancelled && (moved_before || d.completed))) break_group(e, t.p.what);
  if (!t.outcome || kind != PLAIT_E_TIMEOUT) t.outcome = kind, t.msg = msg;
}

void advance(Engine* e, Transfer& t) {
  if (t.over) return;
  const int n = int(t.p.reqs.size());
  std::vector<int>& idx = t.idx;
  std::vector<MPI_Status>& st = t.st;
  idx.resize(size_t(n));
  st.resize(size_t(n));
  int out = 0;
  const int rc = MPI_Testsome(n, t.p.reqs.data(), &out, idx.data(), st.data());
  if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) {
    char msg[1024];
    const uint32_t kind = mpi_error(e, t.p.what, rc, msg, sizeof msg);
    return give_up(e, t, kind, msg);
  }
  for (int k = 0; out != MPI_UNDEFINED && k < out; ++k) {
    MPI_Request& r = t.p.reqs[idx[k]];
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);  // Open MPI keeps a request that failed
    r = MPI_REQUEST_NULL;
    took(e, t, size_t(idx[k]), st[k], rc == MPI_ERR_IN_STATUS ? st[k].MPI_ERROR : MPI_SUCCESS);
  }
  if (t.outcome) {  // a mismatch: the pieces after it must not take the pair's next message
    const Dropped d = cancel_rest(e, t);
    if (d.completed || d.stranded || t.out_of_step) break_group(e, t.p.what);
    t.over = true;
    return;
  }
  if (!t.left) {
    t.over = true;
    return;
  }
  if (e->flagged.load(std::memory_order_acquire)) {
    char msg[kFlagText + 64];
    const uint32_t kind = refused(e, msg, sizeof msg);
    return give_up(e, t, kind, msg);
  }
  if (Clock::now() >= t.deadline) {
    char secs[32];
    snprintf(secs, sizeof secs, "%.3g", t.timeout_s);
    give_up(e, t, PLAIT_E_TIMEOUT,
            where(e, t.p.what) + ": deadline (" + secs + " s) passed waiting for peer " +
                std::to_string(t.peer));
  }
}

}  // namespace mpi
}  // namespace plait
