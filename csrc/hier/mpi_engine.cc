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
// calls with the kind fail() recorded (engine.h: a wrong argument or a mismatch raises the same
// class on every host) and "rank R failed: ...", R the failing process's MPI_COMM_WORLD rank
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
// p2p_start/p2p_test: a send's pieces are all posted at start; a recv's pieces claim their
// messages in order as they come (Improbe + Imrecv), so a message's size is known before it
// lands and a longer one is reported, never truncated (Open MPI 4.1 overruns the buffer when it
// truncates a message past its eager size). p2p_test takes the pieces as they finish
// (Testsome), with the same flag look and deadline as a wait, so any number of sends and recvs
// may be in flight and an exchange between two members cannot wait on itself. A blocking recv
// is a started one, waited.
//
// A call that gives up (deadline, flag) cancels its point-to-point requests; MPI cannot cancel a
// collective, so a collective that gives up is stranded and the group refuses later calls (its
// members are out of step; the communicator aborts after such an error anyway).
#include <stdio.h>
#include <string.h>

#include "hier/mpi_group.h"

namespace plait {
namespace {

using namespace mpi;  // NOLINT: the engine's own helpers

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

// Every piece's Iallreduce at once (a buffer needs several only past `chunk` bytes), waited by
// wait() as allgather_start's are.
uint32_t allreduce_start(void* ctx, void* buf, size_t count, uint8_t dtype, uint8_t op, double,
                         void** req, char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  *req = nullptr;
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
  if (uint32_t k = refused(e, err, errlen)) return k;
  auto p = std::make_unique<Pending>();
  p->bytes = count * es;
  p->what = what();
  char* b = static_cast<char*>(buf);
  int rc = MPI_SUCCESS;
  const size_t step = piece(e, es);
  for (size_t off = 0; e->size > 1 && off < p->bytes && rc == MPI_SUCCESS; off += step) {
    const size_t len = std::min(step, p->bytes - off);
    MPI_Request r = MPI_REQUEST_NULL;
    rc = MPI_Iallreduce(MPI_IN_PLACE, b + off, int(len / es), type, mop, e->data, &r);
    if (rc == MPI_SUCCESS) p->reqs.push_back(r);
  }
  if (rc != MPI_SUCCESS) {
    abandon(e, *p, p->what);
    return mpi_error(e, p->what, rc, err, errlen);
  }
  *req = p.release();
  return PLAIT_OK;
}

uint32_t allgather_start(void* ctx, const void* in, void* out, size_t bytes, void** req, char* err,
                         size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  *req = nullptr;
  auto what = [&] { return "allgather of " + nbytes(bytes); };
  if (uint32_t k = refused(e, err, errlen)) return k;
  auto p = std::make_unique<Pending>();
  p->bytes = bytes;
  p->what = what();
  if (e->size == 1 || bytes == 0) {
    if (bytes) memcpy(out, in, bytes);
    *req = p.release();
    return PLAIT_OK;
  }
  const char* i = static_cast<const char*>(in);
  char* o = static_cast<char*>(out);
  int rc = MPI_SUCCESS;
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
  return finish(e, *p, deadline_of(timeout_s), timeout_s, [&] { return p->what; }, err, errlen);
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

std::string p2p_what(bool is_send, size_t bytes, int peer, int tag) {
  return std::string(is_send ? "send of " : "recv of ") + nbytes(bytes) +
         (is_send ? " to peer " : " from peer ") + std::to_string(peer) + " tag " +
         std::to_string(tag);
}

uint32_t p2p_refused(Engine* e, int peer, int tag, const std::string& what, char* err,
                     size_t errlen) {
  if (peer < 0 || peer >= e->size || peer == e->rank)
    return say(err, errlen, PLAIT_E_INVALID, where(e, what) + ": the peer must be another member");
  if (tag < 0 || tag > e->tag_ub)
    return say(err, errlen, PLAIT_E_INVALID,
               where(e, what) + ": tags go from 0 to " + std::to_string(e->tag_ub));
  return PLAIT_OK;
}

uint32_t send(void* ctx, const void* buf, size_t bytes, int peer, int tag, double timeout_s,
              char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  auto what = [&] { return p2p_what(true, bytes, peer, tag); };
  if (uint32_t k = p2p_refused(e, peer, tag, what(), err, errlen)) return k;
  Pending p;
  p.p2p = true;
  const char* b = static_cast<const char*>(buf);
  return run(
      e, p, bytes, 1, timeout_s, what,
      [&](size_t off, size_t len, MPI_Request* r) {
        return MPI_Isend(b + off, int(len), MPI_BYTE, peer, tag, e->data, r);
      },
      err, errlen);
}

// A send's pieces are posted at once, cut as send() cuts them (0 bytes: one empty message); a
// recv's claim their messages as they come (mpi_group.h's Transfer), in this group's calls and
// any group's waits, so any mix may be in flight and none waits on another.
uint32_t p2p_start(void* ctx, int send, void* buf, size_t bytes, int peer, int tag,
                   double timeout_s, void** req, char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  *req = nullptr;
  std::lock_guard<std::mutex> g(e->calls);
  auto t = std::make_unique<Transfer>();
  t->p.what = p2p_what(send, bytes, peer, tag);
  if (uint32_t k = p2p_refused(e, peer, tag, t->p.what, err, errlen)) return k;
  if (uint32_t k = refused(e, err, errlen)) return k;
  t->p.p2p = true;
  t->p.recv = !send;
  t->p.bytes = bytes;
  t->base = static_cast<char*>(buf);
  t->peer = peer;
  t->tag = tag;
  t->timeout_s = timeout_s;
  t->deadline = deadline_of(timeout_s);
  const size_t step = piece(e, 1);
  size_t off = 0;
  do {
    const size_t len = std::min(step, bytes - off);
    MPI_Request r = MPI_REQUEST_NULL;
    const int rc =
        send ? MPI_Isend(t->base + off, int(len), MPI_BYTE, peer, tag, e->data, &r) : MPI_SUCCESS;
    if (rc != MPI_SUCCESS) {
      char msg[1024];
      const uint32_t kind = mpi_error(e, t->p.what, rc, msg, sizeof msg);
      give_up(e, *t, kind, msg);
      return say(err, errlen, kind, msg);
    }
    t->p.reqs.push_back(r);
    t->lens.push_back(len);
    ++t->left;
    off += len;
  } while (off < bytes);
  t->wanted = t->lens.size();
  if (send) t->matched = t->wanted;
  t->at = e->transfers.insert(e->transfers.end(), t.get());
  if (!send) registry().recvs.fetch_add(1, std::memory_order_relaxed);
  if (!send) claim_upto(e, *t);  // what has come already
  *req = t.release();
  return PLAIT_OK;
}

// engine.h: requests of one (peer, tag, direction) complete in start order. MPI matches them in
// that order but may finish a later small one before an earlier large one, so a request that
// succeeded waits for the earlier ones of its kind, which this test moves on too (the caller
// need not test them first). A request that failed is handed back at once.
uint32_t p2p_test(void* ctx, void* req, int* done, char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  Transfer* t = static_cast<Transfer*>(req);
  *done = 0;
  if (!t) {
    *done = 1;
    return PLAIT_OK;
  }
  const Clock::time_point now = Clock::now();
  if (ns(now) >= registry().next_probe.load(std::memory_order_relaxed)) probe(now);
  std::lock_guard<std::mutex> g(e->calls);
  advance(e, *t);
  if (!t->over) return PLAIT_OK;
  if (!t->outcome)
    for (Transfer* u : e->transfers) {
      if (u == t) break;
      if (u->peer != t->peer || u->tag != t->tag || u->p.recv != t->p.recv) continue;
      advance(e, *u);
      if (!u->over) return PLAIT_OK;
    }
  *done = 1;
  std::unique_ptr<Transfer> own(t);
  e->transfers.erase(t->at);
  if (t->p.recv) registry().recvs.fetch_sub(1, std::memory_order_relaxed);
  return t->outcome ? say(err, errlen, t->outcome, t->msg) : PLAIT_OK;
}

// A blocking recv is a started one, tested as a wait spins, yields and sleeps (finish()), so it
// takes its place among the recvs in flight and never truncates a longer message.
uint32_t recv(void* ctx, void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
              size_t errlen) {
  void* req = nullptr;
  if (uint32_t k = p2p_start(ctx, 0, buf, bytes, peer, tag, timeout_s, &req, err, errlen)) return k;
  const Clock::time_point start = Clock::now();
  for (;;) {
    int done = 0;
    const uint32_t k = p2p_test(ctx, req, &done, err, errlen);
    if (done) return k;
    const auto waited = Clock::now() - start;
    if (waited < kSpin) continue;
    claim_everywhere();
    if (waited < kYield)
      sched_yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(waited < kProbeEvery * 4 ? 100 : 1000));
  }
}

// MPI_Iprobe on the data communicator: the message it finds is the one a recv from its source
// with this tag takes next (MPI keeps one (source, tag) pair's messages in order, and one thread
// at a time calls this group). A message of a whole piece may be the first of several (p2p cuts
// long ones), so its size is told only when it is shorter than a piece. A message a started recv
// of its (source, tag) waits for is that recv's: it claims it, and the probe looks again.
uint32_t probe_tag(void* ctx, int tag, int* src, size_t* bytes, char* err, size_t errlen) {
  Engine* e = static_cast<Engine*>(ctx);
  *src = -1;
  *bytes = 0;
  auto what = [&] { return "probe of tag " + std::to_string(tag); };
  if (tag < 0 || tag > e->tag_ub)
    return say(err, errlen, PLAIT_E_INVALID,
               where(e, what()) + ": tags go from 0 to " + std::to_string(e->tag_ub));
  const Clock::time_point now = Clock::now();
  if (ns(now) >= registry().next_probe.load(std::memory_order_relaxed)) probe(now);
  if (uint32_t k = refused(e, err, errlen)) return k;
  std::lock_guard<std::mutex> g(e->calls);
  int found = 0;
  MPI_Status st;
  for (size_t looks = 0; looks <= e->transfers.size(); ++looks) {
    const int rc = MPI_Iprobe(MPI_ANY_SOURCE, tag, e->data, &found, &st);
    if (rc != MPI_SUCCESS) return mpi_error(e, what(), rc, err, errlen);
    if (!found || !awaited(e, st.MPI_SOURCE, tag)) break;
    found = 0;
  }
  if (!found) return PLAIT_OK;
  int n = 0;
  MPI_Get_count(&st, MPI_BYTE, &n);
  *src = st.MPI_SOURCE;
  *bytes = size_t(std::max(n, 0)) < piece(e, 1) ? size_t(std::max(n, 0)) : PLAIT_ENGINE_UNKNOWN;
  return PLAIT_OK;
}

void fail(void* ctx, uint32_t kind, const char* msg) {
  Engine* me = static_cast<Engine*>(ctx);
  std::string text = msg ? msg : "";
  if (text.size() > kFlagText) text.resize(kFlagText);
  const std::string flag = "rank " + std::to_string(me->world_rank) + " failed: " + text;
  Registry& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  if (!set_flag(me, kind, flag)) return;  // a failure is already known here: the first stands
  for (Engine* e : r.engines) set_flag(e, kind, flag);
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
  for (Transfer* t : e->transfers) {  // as a give-up: unclaimed recvs take nothing more
    if (!finalized && !t->over) give_up(e.get(), *t, PLAIT_E_PEER_LOST, "released");
    if (t->p.recv) r.recvs.fetch_sub(1, std::memory_order_relaxed);
    delete t;
  }
  e->transfers.clear();
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
  t.allreduce_start = allreduce_start;
  t.wait = wait;
  t.broadcast = broadcast;
  t.alltoall = alltoall;
  t.send = send;
  t.recv = recv;
  t.probe = probe_tag;
  t.p2p_start = p2p_start;
  t.p2p_test = p2p_test;
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
