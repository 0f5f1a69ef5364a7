// The engine groups and the cross-host check (hier/hier_comm.h): every call's first engine
// message is one frame per member (kFrameHead + the room, hier_comm.h), header compared by every
// member.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "bindings/capi.h"
#include "core/wait.h"
#include "hier/hier_comm.h"
#include "reduce/reduce.h"

namespace plait {

namespace {
// The compared part of a frame's header; the rest of kFrameHead is zero.
struct FrameHead {
  uint64_t magic;
  Fingerprint fp;
  int64_t payload;
};
static_assert(sizeof(FrameHead) <= kFrameHead, "the header fits its slot");

double left(double deadline) {
  if (std::isinf(deadline)) return deadline;
  const double t = deadline - now_s();
  return t > 0 ? t : 0;
}

// "allreduce #3 (count 7, dtype float32, op sum, root -1)"
std::string describe(const Fingerprint& f) {
  std::ostringstream m;
  m << (f.coll < uint8_t(Coll::kCount) ? coll_name(Coll(f.coll)) : "collective code ?") << " #"
    << f.seq << " (count " << f.count << ", dtype "
    << (f.dtype < uint8_t(DType::kCount) ? dtype_name(DType(f.dtype)) : "?") << ", op "
    << (f.op < uint8_t(RedOp::kCount) ? op_name(RedOp(f.op)) : "-") << ", root " << f.root << ")";
  return m.str();
}
}  // namespace

EngineGroup::EngineGroup(plait_engine* e, std::string label, std::vector<int> ranks)
    : e_(e), label_(std::move(label)), ranks_(std::move(ranks)) {
  send_.assign(kFrame, 0);
  recv_.assign(size_t(e_->size > 0 ? e_->size : 1) * kFrame, 0);
}

EngineGroup::~EngineGroup() {
  if (e_ && e_->release) e_->release(e_->ctx);
}

std::string EngineGroup::what() const {
  std::ostringstream m;
  m << "the inter-host " << e_->name << " group " << label_ << " (global ranks [";
  for (size_t k = 0; k < ranks_.size(); ++k) m << (k ? ", " : "") << ranks_[k];
  m << "])";
  return m.str();
}

void EngineGroup::check(uint32_t rc, const char* op, const char* err) {
  if (rc == PLAIT_OK) return;
  const ErrorKind kind = rc <= uint32_t(ErrorKind::peer_lost) ? ErrorKind(rc) : ErrorKind::generic;
  throw_error(kind, std::string(op) + " on " + what() + ": " + err);
}

void EngineGroup::allreduce(void* buf, int64_t count, DType dt, RedOp op, double deadline) {
  if (count == 0 || size() == 1) return;
  char err[1024] = "";
  if (e_->supports(e_->ctx, uint8_t(dt), uint8_t(op))) {
    check(e_->allreduce(e_->ctx, buf, size_t(count), uint8_t(dt), uint8_t(op), left(deadline), err,
                        sizeof err),
          "allreduce", err);
    return;
  }
  // bool as bytes: or is max, and is min
  const RedOp as_u8 = (op == RedOp::sum || op == RedOp::max) ? RedOp::max : RedOp::min;
  if (dt == DType::boolean && e_->supports(e_->ctx, uint8_t(DType::u8), uint8_t(as_u8))) {
    check(e_->allreduce(e_->ctx, buf, size_t(count), uint8_t(DType::u8), uint8_t(as_u8),
                        left(deadline), err, sizeof err),
          "allreduce", err);
    return;
  }
  // The engine lacks it: every member's buffer, reduced here in group (host) order, so every
  // member computes the same bytes.
  const size_t bytes = size_t(count) * dtype_size(dt);
  std::vector<uint8_t> all(bytes * size_t(size()));
  allgather(buf, all.data(), bytes, deadline);
  std::vector<const void*> srcs;
  for (int j = 0; j < size(); ++j) srcs.push_back(all.data() + size_t(j) * bytes);
  reduce(dt, op, buf, srcs.data(), size(), size_t(count), 0);
}

bool EngineGroup::can_start(DType dt, RedOp op) const {
  if (!PLAIT_ENGINE_HAS(e_, allreduce_start)) return false;
  if (dt == DType::boolean) {
    dt = DType::u8;
    op = (op == RedOp::sum || op == RedOp::max) ? RedOp::max : RedOp::min;
  }
  return e_->supports(e_->ctx, uint8_t(dt), uint8_t(op)) != 0;
}

void* EngineGroup::allreduce_start(void* buf, int64_t count, DType dt, RedOp op, double deadline) {
  if (count == 0 || size() == 1) return nullptr;
  if (!can_start(dt, op)) {
    allreduce(buf, count, dt, op, deadline);
    return nullptr;
  }
  if (dt == DType::boolean) {  // as allreduce does it: or is max, and is min, over bytes
    dt = DType::u8;
    op = (op == RedOp::sum || op == RedOp::max) ? RedOp::max : RedOp::min;
  }
  char err[1024] = "";
  void* req = nullptr;
  check(e_->allreduce_start(e_->ctx, buf, size_t(count), uint8_t(dt), uint8_t(op), left(deadline),
                            &req, err, sizeof err),
        "allreduce", err);
  return req;
}

void EngineGroup::allgather(const void* in, void* out, size_t bytes, double deadline) {
  if (bytes == 0) return;
  char err[1024] = "";
  check(e_->allgather(e_->ctx, in, out, bytes, left(deadline), err, sizeof err), "allgather", err);
}

void* EngineGroup::allgather_start(const void* in, void* out, size_t bytes) {
  char err[1024] = "";
  void* req = nullptr;
  check(e_->allgather_start(e_->ctx, in, out, bytes, &req, err, sizeof err), "allgather", err);
  return req;
}

void EngineGroup::wait(void* req, double deadline) {
  if (!req) return;
  char err[1024] = "";
  check(e_->wait(e_->ctx, req, left(deadline), err, sizeof err), "wait", err);
}

void EngineGroup::broadcast(void* buf, size_t bytes, int root, double deadline) {
  if (bytes == 0 || size() == 1) return;
  char err[1024] = "";
  check(e_->broadcast(e_->ctx, buf, bytes, root, left(deadline), err, sizeof err), "broadcast",
        err);
}

void EngineGroup::alltoall(const void* in, void* out, size_t block, double deadline) {
  if (block == 0) return;
  char err[1024] = "";
  check(e_->alltoall(e_->ctx, in, out, block, left(deadline), err, sizeof err), "alltoall", err);
}

// A zero-byte message travels where the engine can probe (a receive from any rank must find
// it); an engine without probe carries none, on both sides alike.
void EngineGroup::send(const void* buf, size_t bytes, int peer, int tag, double deadline) {
  if (bytes == 0 && !can_probe()) return;
  char err[1024] = "";
  check(e_->send(e_->ctx, buf, bytes, peer, tag, left(deadline), err, sizeof err), "send", err);
}

void EngineGroup::recv(void* buf, size_t bytes, int peer, int tag, double deadline) {
  if (bytes == 0 && !can_probe()) return;
  char err[1024] = "";
  check(e_->recv(e_->ctx, buf, bytes, peer, tag, left(deadline), err, sizeof err), "recv", err);
}

void* EngineGroup::p2p_start(bool send, void* buf, size_t bytes, int peer, int tag,
                             double deadline) {
  if (bytes == 0 && !can_probe()) return nullptr;  // as send/recv: nothing travels
  char err[1024] = "";
  void* req = nullptr;
  check(e_->p2p_start(e_->ctx, send ? 1 : 0, buf, bytes, peer, tag, left(deadline), &req, err,
                      sizeof err),
        send ? "send" : "recv", err);
  return req;
}

bool EngineGroup::p2p_test(void* req) {
  char err[1024] = "";
  int done = 0;
  check(e_->p2p_test(e_->ctx, req, &done, err, sizeof err), "send/recv", err);
  return done != 0;
}

int EngineGroup::probe(int tag, size_t* bytes) {
  char err[1024] = "";
  int src = -1;
  check(e_->probe(e_->ctx, tag, &src, bytes, err, sizeof err), "probe", err);
  return src;
}

void EngineGroup::fail(ErrorKind kind, const std::string& msg) {
  e_->fail(e_->ctx, uint32_t(kind), msg.c_str());
}

void HierComm::head(EngineGroup& g, const Fingerprint& fp, size_t nbytes) {
  FrameHead h{kFrameMagic, fp, int64_t(nbytes)};
  std::memset(g.sent().data(), 0, kFrameHead);
  std::memcpy(g.sent().data(), &h, sizeof h);
}

HierComm::Posted HierComm::post(EngineGroup* g, const Fingerprint& fp, size_t nbytes,
                                bool check_only, double deadline) {
  Posted p;
  if (!g || (check_only && !check_)) return p;
  head(*g, fp, check_only ? 0 : nbytes);
  p.g = g;
  p.fp = &fp;
  p.req = g->allgather_start(g->sent().data(), g->got().data(), frame());
  return p;
}

const uint8_t* HierComm::finish(Posted& p, double deadline) {
  if (!p.g) return nullptr;
  EngineGroup& g = *p.g;
  void* req = p.req;
  p.g = nullptr;
  g.wait(req, deadline);
  return compare(g, *p.fp);
}

const uint8_t* HierComm::compare(EngineGroup& g, const Fingerprint& fp) {
  const uint8_t* got = g.got().data();
  for (int j = 0; j < g.size(); ++j)
    if (std::memcmp(got + size_t(j) * frame(), g.sent().data(), sizeof(FrameHead)) != 0)
      mismatch(g, fp, got + size_t(j) * frame(), j);
  return got + kFrameHead;
}

const uint8_t* HierComm::exchange(EngineGroup* g, const Fingerprint& fp, size_t nbytes,
                                  double deadline, bool check_only) {
  // Nothing to overlap: one blocking allgather (one engine call, not a start and a wait).
  if (!g || (check_only && !check_)) return nullptr;
  head(*g, fp, check_only ? 0 : nbytes);
  g->allgather(g->sent().data(), g->got().data(), frame(), deadline);
  return compare(*g, fp);
}

void HierComm::mismatch(EngineGroup& g, const Fingerprint& mine, const uint8_t* theirs, int j) {
  FrameHead t;
  std::memcpy(&t, theirs, sizeof t);
  const int peer = g.ranks()[size_t(j)];
  std::ostringstream m;
  m << "rank " << rank_ << ": mismatched calls across hosts: this rank (host " << lay_.h
    << ") called " << describe(mine) << " but rank " << peer << " (host "
    << lay_.host_of[size_t(peer)] << ") of its inter-host " << g.engine() << " group ";
  if (t.magic != kFrameMagic) {
    m << "sent something that is not a plait call frame";
  } else {
    const Fingerprint& f = t.fp;
    const std::string diff = fingerprint_diff(f, mine, false);
    m << "called " << describe(f) << " (they differ in " << (diff.empty() ? "payload size" : diff)
      << ")";
  }
  throw MismatchError(m.str());
}

void HierComm::combine(void* out, const uint8_t* rows, int n, size_t off, int64_t count, DType dt,
                       RedOp op) {
  if (count == 0) return;
  std::vector<const void*> srcs;
  for (int j = 0; j < n; ++j) srcs.push_back(rows + size_t(j) * frame() + off);
  reduce(dt, op, out, srcs.data(), n, size_t(count), op == RedOp::avg ? size_ : 0);
}

void HierComm::adapt() {
  const size_t want = want_;
  want_ = 0;
  if (!adaptive_) return;
  size_t need = kMinRoom;  // the room this call's payload wanted (kMinRoom: none, or too big)
  if (want <= kRoom)
    while (need < want) need *= 2;
  need = std::min(need, kRoom);
  if (need > room_ / 2) {  // grows at once, or stays
    room_ = std::max(room_, need);
    shrink_run_ = 0;
    shrink_to_ = kMinRoom;
    return;
  }
  shrink_to_ = std::max(shrink_to_, need);
  if (++shrink_run_ >= kShrinkAfter) {  // kShrinkAfter calls in a row fitted half the room
    room_ = shrink_to_;
    shrink_run_ = 0;
    shrink_to_ = kMinRoom;
  }
}

void HierComm::divide(void* buf, int64_t count, DType dt) {
  if (count == 0) return;
  const void* src = buf;
  reduce(dt, RedOp::avg, buf, &src, 1, size_t(count), size_);
}

}  // namespace plait
