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

// p2p_start's transfers (mpi_engine.cc has the calls). Piece i finished: a recv counts its
// bytes (its size was checked when it claimed its message).
static void took(Engine* e, Transfer& t, size_t i, MPI_Status& st, int error) {
  --t.left;
  int n = 0;
  if (t.p.recv) MPI_Get_count(&st, MPI_BYTE, &n);
  if (t.outcome) return;  // the first problem found stands
  if (error != MPI_SUCCESS) {
    char msg[1024];
    t.outcome = mpi_error(e, t.p.what, error, msg, sizeof msg);
    t.msg = msg;
  } else {
    t.got += size_t(std::max(n, 0));
  }
}

// A recv's pieces claim the messages that have come for them, in order, until one finds none
// (false) or all have theirs. A message of another size than its piece ends the recv there
// (the pieces after it take nothing): a shorter one is received into the piece, a longer one
// aside (MPI would truncate it). Only the sender's last piece is short of a whole chunk, so a
// longer message of a whole chunk may have more of the sender's behind it, which the pair's
// next recv would take: the group is then out of step.
static bool claim(Engine* e, Transfer& t) {
  const size_t whole = piece(e, 1);
  while (t.matched < t.wanted) {
    int found = 0;
    MPI_Message m = MPI_MESSAGE_NULL;
    MPI_Status st;
    int rc = MPI_Improbe(t.peer, t.tag, e->data, &found, &m, &st);
    if (rc == MPI_SUCCESS && !found) return false;
    const size_t i = t.matched, len = t.lens[i], before = i * t.lens[0];
    int n = 0;
    if (rc == MPI_SUCCESS) rc = MPI_Get_count(&st, MPI_BYTE, &n);
    const size_t size = size_t(std::max(n, 0));
    char* into = t.base + before;
    if (rc == MPI_SUCCESS && size != len) {
      const bool longer = size > len;
      t.outcome = PLAIT_E_MISMATCH;
      t.msg = where(e, t.p.what) + ": the message had " +
              (longer && size >= whole ? "at least " : "") + std::to_string(before + size) +
              " bytes";
      t.left -= t.wanted - i - 1;  // the pieces after it
      t.wanted = i + 1;
      if (longer) {
        try {
          t.aside.resize(size);
          into = t.aside.data();
        } catch (const std::bad_alloc&) {
          t.msg += " (and no memory to receive it: it stays with MPI)";
          break_group(e, t.p.what);
          --t.left;
          t.matched = t.wanted;
          return true;
        }
        if (size >= whole) break_group(e, t.p.what);
      }
    }
    if (rc == MPI_SUCCESS) rc = MPI_Imrecv(into, n, MPI_BYTE, &m, &t.p.reqs[i]);
    ++t.matched;
    if (rc != MPI_SUCCESS) {  // a message claimed and lost, or a part taken: out of step
      char msg[1024];
      t.outcome = mpi_error(e, t.p.what, rc, msg, sizeof msg);
      t.msg = msg;
      if (found || i > 0) break_group(e, t.p.what);
      t.left -= t.wanted - i;
      t.wanted = t.matched = i;
      return true;
    }
  }
  return true;
}

void claim_upto(Engine* e, Transfer& t) {
  for (Transfer* u : e->transfers) {
    if (u->peer != t.peer || u->tag != t.tag || !u->p.recv || u->over) {
      if (u == &t) return;
      continue;
    }
    if (!claim(e, *u) || u == &t) return;
  }
}

static void claim_all(Engine* e) {
  std::vector<std::pair<int, int>> waiting;  // (peer, tag) whose earlier recv has no message yet
  for (Transfer* u : e->transfers) {
    if (!u->p.recv || u->over || u->matched == u->wanted) continue;
    const std::pair<int, int> key(u->peer, u->tag);
    if (std::find(waiting.begin(), waiting.end(), key) != waiting.end()) continue;
    if (!claim(e, *u)) waiting.push_back(key);
  }
}

void claim_everywhere() {
  Registry& r = registry();
  if (!r.recvs.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> g(r.mu);
  for (Engine* e : r.engines) {
    std::unique_lock<std::mutex> busy(e->calls, std::try_to_lock);
    if (busy.owns_lock() && !e->transfers.empty()) claim_all(e);
  }
}

bool awaited(Engine* e, int src, int tag) {
  for (Transfer* u : e->transfers)
    if (u->p.recv && !u->over && u->peer == src && u->tag == tag && u->matched < u->wanted) {
      claim_upto(e, *u);
      return true;
    }
  return false;
}

// Cancels t's pieces in flight and drops a recv's pieces without a message (cancelled). A piece
// that finishes meanwhile is taken; one MPI neither cancels nor finishes (a send whose receiver
// is under way, or Open MPI's ob1, which cancels no send; a recv under way) is freed and left
// to MPI: it completes or dies with the job, and the group is broken.
namespace {
struct Dropped {
  size_t cancelled = 0, completed = 0, stranded = 0;
};
}  // namespace
static Dropped cancel_rest(Engine* e, Transfer& t) {
  Dropped d;
  d.cancelled = t.wanted - t.matched;
  t.left -= d.cancelled;
  t.wanted = t.matched;
  for (size_t i = 0; i < t.p.reqs.size(); ++i) {
    MPI_Request& r = t.p.reqs[i];
    if (r == MPI_REQUEST_NULL) continue;
    if (!t.p.recv) MPI_Cancel(&r);  // a claimed message cannot be given back
    MPI_Status st;
    int done = 0, cancelled = 0;
    for (int k = 0; k < 1000 && !done; ++k) MPI_Test(&r, &done, &st);
    if (!done) {
      MPI_Request_free(&r);
      ++d.stranded;
      --t.left;
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
  // a recv's claimed pieces took their messages; a send's finished pieces went
  const bool moved_before = t.p.recv ? t.matched > 0 : t.left < t.lens.size();
  const Dropped d = cancel_rest(e, t);
  t.over = true;
  if (!d.cancelled && !d.stranded) return;  // it finished after all
  if (d.stranded || moved_before || d.completed) break_group(e, t.p.what);
  if (!t.outcome || kind != PLAIT_E_TIMEOUT) t.outcome = kind, t.msg = msg;
}

void advance(Engine* e, Transfer& t) {
  if (t.over) return;
  if (t.p.recv && t.matched < t.wanted) claim_upto(e, t);
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
  if (!t.left) {
    t.over = true;
    return;
  }
  if (t.outcome && !t.p.recv) {  // a send's piece failed: the others go too
    const Dropped d = cancel_rest(e, t);
    if (d.completed || d.stranded) break_group(e, t.p.what);
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
