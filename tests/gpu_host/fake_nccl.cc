// The fake NCCL (fake_nccl.h).
#include "fake_nccl.h"

#include <time.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fake_cuda.h"
#include "reduce/reduce.h"

namespace n = plait::nccl;
using plait::DType;
using plait::RedOp;

namespace fake {
namespace {

struct World {
  int size = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int> joined{0};
  std::atomic<bool> broken{false};
  std::map<std::pair<int, int>, std::deque<std::vector<char>>> box;  // (from, to) FIFOs
};

std::mutex g_mu;
std::vector<std::unique_ptr<World>> g_worlds;
std::atomic<int> g_fail_send[64];

World* world_of(const n::UniqueId& id) {
  uint64_t i = 0;
  std::memcpy(&i, id.internal, sizeof i);
  std::lock_guard<std::mutex> l(g_mu);
  return i < g_worlds.size() ? g_worlds[i].get() : nullptr;
}

}  // namespace
}  // namespace fake

namespace plait {
namespace nccl {
struct ncclComm {
  fake::World* w = nullptr;
  int rank = 0;
  bool blocking = true;
  std::atomic<bool> aborted{false}, inprogress{false}, finalized{false};
  std::atomic<int> async{n::Success};
  std::string last;
};
}  // namespace nccl
}  // namespace plait

namespace fake {
namespace {

using Comm = n::ncclComm;

struct Op {
  bool send;
  Comm* c;
  const void* sbuf;
  void* rbuf;
  size_t bytes;
  int peer;
  cudaStream_t s;
};
thread_local std::vector<Op> tl_ops;
thread_local int tl_depth = 0;
thread_local std::function<void()> tl_hook;

double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

bool dead(Comm* c) { return c->aborted || c->async != n::Success; }

void xsend(Comm* c, int peer, const void* buf, size_t bytes) {
  if (dead(c)) return;
  World* w = c->w;
  {
    std::lock_guard<std::mutex> l(w->mu);
    const char* p = static_cast<const char*>(buf);
    w->box[{c->rank, peer}].emplace_back(p, p + bytes);
  }
  w->cv.notify_all();
}

// Blocks the stream until the message from `peer` is there; gives up (the communicator's async
// error) when the communicator is aborted or its world broke.
bool xrecv(Comm* c, int peer, void* buf, size_t bytes) {
  if (dead(c)) return false;
  World* w = c->w;
  std::unique_lock<std::mutex> l(w->mu);
  auto& q = w->box[{peer, c->rank}];
  const double t0 = now_s();
  while (q.empty() && !c->aborted && !w->broken) {
    if (now_s() - t0 > kHangS) break;
    w->cv.wait_for(l, std::chrono::milliseconds(5));
  }
  if (q.empty()) {
    if (!c->aborted) {
      c->last = "fake NCCL: the peer's data never came (rank " + std::to_string(peer) + ")";
      c->async = n::RemoteError;
    }
    return false;
  }
  std::vector<char> m = std::move(q.front());
  q.pop_front();
  if (m.size() != bytes) {
    c->last = "fake NCCL: " + std::to_string(m.size()) + " bytes sent, " + std::to_string(bytes) +
              " received";
    c->async = n::InvalidUsage;
    return false;
  }
  std::memcpy(buf, m.data(), bytes);
  return true;
}

void launch_ops(std::vector<Op> ops) {
  launch(ops[0].s, [ops] {
    jitter();
    for (const Op& o : ops)
      if (o.send) xsend(o.c, o.peer, o.sbuf, o.bytes);
    for (const Op& o : ops)
      if (!o.send && !xrecv(o.c, o.peer, o.rbuf, o.bytes)) return;
  });
}

DType dtype_of(n::DataType t) {
  switch (t) {
    case n::Int8:
      return DType::i8;
    case n::Uint8:
      return DType::u8;
    case n::Int32:
      return DType::i32;
    case n::Int64:
      return DType::i64;
    case n::Float16:
      return DType::f16;
    case n::Float32:
      return DType::f32;
    case n::Float64:
      return DType::f64;
    case n::Bfloat16:
      return DType::bf16;
    default:
      return DType::kCount;
  }
}

RedOp op_of(n::RedOp o) {
  static const RedOp ops[] = {RedOp::sum, RedOp::prod, RedOp::max, RedOp::min, RedOp::avg};
  return ops[int(o)];
}

n::Result issued(Comm* c) {
  if (c->blocking) return n::Success;
  c->inprogress = true;
  return n::InProgress;
}

n::Result check_issue(Comm* c, cudaStream_t s) {
  if (!c || c->aborted) return n::InvalidUsage;
  if (c->async != n::Success) return n::Result(c->async.load());  // ncclCommEnsureReady
  if (s == cudaStreamPerThread && !c->blocking) ++nccl_stats().ptds_launches;
  return n::Success;
}

// A collective: every rank sends what each peer needs, then receives and combines, in rank order.
n::Result collective(Comm* c, cudaStream_t s, std::function<void(Comm*)> body) {
  const n::Result r = check_issue(c, s);
  if (r != n::Success) return r;
  if (tl_depth > 0) return n::InvalidUsage;  // plait never groups collectives
  launch(s, [c, body] {
    jitter();
    if (!dead(c)) body(c);
  });
  return issued(c);
}

// Receives every peer's block into bufs[peer] (own: mine), then reduces them in rank order.
void reduce_from_all(Comm* c, const void* mine, void* out, size_t count, n::DataType t, n::RedOp op,
                     bool to_self_only_root, int root) {
  (void)to_self_only_root, (void)root;
  const int size = c->w->size;
  const size_t bytes = count * plait::dtype_size(dtype_of(t));
  std::vector<std::vector<char>> got(static_cast<size_t>(size));
  std::vector<const void*> srcs;
  for (int p = 0; p < size; ++p) {
    if (p == c->rank) {
      srcs.push_back(mine);
      continue;
    }
    got[size_t(p)].resize(bytes);
    if (!xrecv(c, p, got[size_t(p)].data(), bytes)) return;
    srcs.push_back(got[size_t(p)].data());
  }
  if (count)
    plait::reduce(dtype_of(t), op_of(op), out, srcs.data(), size, count, op == n::Avg ? size : 0);
}

n::Result GetVersion(int* v) {
  *v = 23206;
  return n::Success;
}
n::Result GetUniqueId(n::UniqueId*) { return n::InvalidUsage; }

n::Result CommInitRankConfig(n::Comm* out, int size, n::UniqueId id, int rank, n::Config* cfg) {
  World* w = world_of(id);
  if (!w || w->size != size || rank < 0 || rank >= size) return n::InvalidArgument;
  Comm* c = new Comm;
  c->w = w;
  c->rank = rank;
  c->blocking = cfg ? cfg->blocking != 0 : true;
  ++w->joined;
  ++nccl_stats().inits;
  *out = c;
  if (!c->blocking) return n::InProgress;
  const double t0 = now_s();
  while (w->joined < size && now_s() - t0 < kHangS) std::this_thread::yield();
  return w->joined >= size ? n::Success : n::Timeout;
}

n::Result CommFinalize(n::Comm c) {
  ++nccl_stats().finalizes;
  c->finalized = true;
  return issued(c);
}

n::Result CommDestroy(n::Comm c) {
  // Before ncclCommFinalize the whole teardown would run here, blocking, with no deadline.
  if (!c->finalized) ++nccl_stats().unfinalized_destroys;
  ++nccl_stats().destroys;
  c->aborted = true;
  return n::Success;
}

n::Result CommAbort(n::Comm c) {
  ++nccl_stats().aborts;
  // Inside an open group NCCL only queues the reclaim (ncclAsyncLaunch): the abort flag is set,
  // the communicator never freed, and the group stays open on this thread.
  if (tl_depth > 0) ++nccl_stats().lost_aborts;
  c->aborted = true;
  c->w->cv.notify_all();
  return n::Success;
}

n::Result CommGetAsyncError(n::Comm c, n::Result* st) {
  if (tl_hook) {
    std::function<void()> h;
    h.swap(tl_hook);
    h();
  }
  if (c->async != n::Success)
    *st = n::Result(c->async.load());
  else if (c->w->joined < c->w->size || c->inprogress.exchange(false))
    *st = n::InProgress;
  else
    *st = n::Success;
  return n::Success;
}

const char* GetErrorString(n::Result r) {
  static const char* const names[] = {"no error",
                                      "unhandled cuda error",
                                      "unhandled system error",
                                      "internal error",
                                      "invalid argument",
                                      "invalid usage",
                                      "remote process exited or there was a network error",
                                      "NCCL operation in progress",
                                      "timeout"};
  return unsigned(r) < 9 ? names[r] : "unknown";
}

const char* GetLastError(n::Comm c) { return c ? c->last.c_str() : ""; }

n::Result AllReduce(const void* in, void* out, size_t count, n::DataType t, n::RedOp op, n::Comm c,
                    cudaStream_t s) {
  return collective(c, s, [=](Comm* k) {
    const size_t bytes = count * plait::dtype_size(dtype_of(t));
    for (int p = 0; p < k->w->size; ++p)
      if (p != k->rank) xsend(k, p, in, bytes);
    reduce_from_all(k, in, out, count, t, op, false, 0);
  });
}

n::Result ReduceScatter(const void* in, void* out, size_t count, n::DataType t, n::RedOp op,
                        n::Comm c, cudaStream_t s) {
  return collective(c, s, [=](Comm* k) {
    const size_t bytes = count * plait::dtype_size(dtype_of(t));
    const char* base = static_cast<const char*>(in);
    for (int p = 0; p < k->w->size; ++p)
      if (p != k->rank) xsend(k, p, base + size_t(p) * bytes, bytes);
    std::vector<char> mine(base + size_t(k->rank) * bytes, base + size_t(k->rank + 1) * bytes);
    reduce_from_all(k, mine.data(), out, count, t, op, false, 0);
  });
}

n::Result AllGather(const void* in, void* out, size_t count, n::DataType t, n::Comm c,
                    cudaStream_t s) {
  return collective(c, s, [=](Comm* k) {
    const size_t bytes = count * plait::dtype_size(dtype_of(t));
    char* o = static_cast<char*>(out);
    for (int p = 0; p < k->w->size; ++p)
      if (p != k->rank) xsend(k, p, in, bytes);
    std::memmove(o + size_t(k->rank) * bytes, in, bytes);
    for (int p = 0; p < k->w->size; ++p)
      if (p != k->rank && !xrecv(k, p, o + size_t(p) * bytes, bytes)) return;
  });
}

n::Result Broadcast(const void* in, void* out, size_t count, n::DataType t, int root, n::Comm c,
                    cudaStream_t s) {
  return collective(c, s, [=](Comm* k) {
    const size_t bytes = count * plait::dtype_size(dtype_of(t));
    if (k->rank == root) {
      for (int p = 0; p < k->w->size; ++p)
        if (p != root) xsend(k, p, in, bytes);
      if (out != in) std::memmove(out, in, bytes);
    } else {
      xrecv(k, root, out, bytes);
    }
  });
}

n::Result Reduce(const void* in, void* out, size_t count, n::DataType t, n::RedOp op, int root,
                 n::Comm c, cudaStream_t s) {
  return collective(c, s, [=](Comm* k) {
    const size_t bytes = count * plait::dtype_size(dtype_of(t));
    if (k->rank != root) return xsend(k, root, in, bytes);
    reduce_from_all(k, in, out, count, t, op, true, root);
  });
}

n::Result p2p(bool send, const void* sbuf, void* rbuf, size_t count, n::DataType t, int peer,
              n::Comm c, cudaStream_t s) {
  const n::Result r = check_issue(c, s);
  if (r != n::Success) return r;
  if (send) {
    ++nccl_stats().sends;
    const int rank = c->rank;
    if (rank < 64 && g_fail_send[rank] > 0 && --g_fail_send[rank] == 0) {
      c->last = "fake NCCL: injected send failure";
      c->async = n::RemoteError;
      return n::RemoteError;
    }
  } else {
    ++nccl_stats().recvs;
  }
  tl_ops.push_back({send, c, sbuf, rbuf, count * plait::dtype_size(dtype_of(t)), peer, s});
  if (tl_depth > 0) return n::Success;
  std::vector<Op> ops;
  ops.swap(tl_ops);
  launch_ops(std::move(ops));
  return issued(c);
}

n::Result Send(const void* buf, size_t count, n::DataType t, int peer, n::Comm c, cudaStream_t s) {
  return p2p(true, buf, nullptr, count, t, peer, c, s);
}

n::Result Recv(void* buf, size_t count, n::DataType t, int peer, n::Comm c, cudaStream_t s) {
  return p2p(false, nullptr, buf, count, t, peer, c, s);
}

n::Result GroupStart() {
  ++tl_depth;
  return n::Success;
}

n::Result GroupEnd() {
  if (tl_depth == 0) return n::InvalidUsage;
  if (--tl_depth > 0) return n::Success;
  ++nccl_stats().groups;
  if (tl_ops.empty()) return n::Success;
  std::vector<Op> ops;
  ops.swap(tl_ops);
  Comm* c = ops[0].c;
  launch_ops(std::move(ops));
  return issued(c);
}

}  // namespace

const plait::NcclApi& nccl_api() {
  static const plait::NcclApi api = {
      GetVersion,    GetUniqueId,       CommInitRankConfig, CommFinalize, CommDestroy,
      CommAbort,     CommGetAsyncError, GetErrorString,     GetLastError, AllReduce,
      ReduceScatter, AllGather,         Broadcast,          Reduce,       Send,
      Recv,          GroupStart,        GroupEnd,           23206,        "fake"};
  return api;
}

n::UniqueId nccl_world(int size) {
  std::lock_guard<std::mutex> l(g_mu);
  g_worlds.push_back(std::make_unique<World>());
  g_worlds.back()->size = size;
  n::UniqueId id{};
  const uint64_t i = g_worlds.size() - 1;
  std::memcpy(id.internal, &i, sizeof i);
  return id;
}

NcclStats& nccl_stats() {
  static NcclStats s;
  return s;
}

void nccl_reset_stats() {
  NcclStats& s = nccl_stats();
  for (auto* a : {&s.inits, &s.aborts, &s.lost_aborts, &s.finalizes, &s.unfinalized_destroys,
                  &s.destroys, &s.ptds_launches, &s.groups, &s.sends, &s.recvs})
    *a = 0;
}

int nccl_group_depth() { return tl_depth; }

void nccl_on_async_error(std::function<void()> hook) { tl_hook = std::move(hook); }

void nccl_fail_send(int rank, int nth) { g_fail_send[rank] = nth; }

void nccl_break_world(const n::UniqueId& id) {
  World* w = world_of(id);
  w->broken = true;
  w->cv.notify_all();
}

}  // namespace fake
