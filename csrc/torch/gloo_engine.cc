// The gloo engine (hier/engine.h) over torch's own ProcessGroupGloo, driven through the generic
// c10d::Backend interface: the CPU wheel ships ProcessGroupGloo.hpp but not gloo's headers, so
// plait never touches gloo itself. Tensors are at::from_blob views of the caller's buffers.
//
// Waiting. A collective's Future wakes a condition variable when gloo finishes it; the caller
// first spins (yielding) for PLAIT_ENGINE_SPIN_US (an 8-byte step takes ~100 us), then sleeps on
// the variable in slices of at most 50 ms and looks at the job-wide flag in the store between
// slices, so the store sees one round trip per 50 ms of waiting and none on a fast call.
// send/recv Works complete only inside Work::wait(): a pool thread waits there for each.
//
// Point to point. gloo matches a receive by (sender, tag) and has no probe, so every send first
// sends a header {tag, bytes} on the reserved tag kHeaderTag (2^31 - 1), with the payload inside
// it up to kInline bytes (a small message is one gloo message), else followed by the payload on
// the caller's tag (both issued at once). From its first send, recv or probe on, the group keeps
// one receive of headers posted per other member (the inbox: a thread per member waits on it,
// queues what arrived and posts the next), so recv(p, t) takes the first queued header of (p, t)
// and then, unless it was inline, receives the payload from p on t (gloo keeps one (sender, tag)
// pair's messages in order), and probe(t) looks at the queue. gloo cannot cancel a posted
// receive, so the inbox's receives are never given up on while the group lives: they wait
// without a deadline, into tensors their Works own, and are aborted only at release. A member
// that dies closes its connection, which ends its inbox thread: a recv from it fails then.
//
// Deadlines. Every op gets gloo's own per-op timeout = the call's time left + kMarginMs. When
// plait's deadline passes, gloo ends the op itself soon after and the call returns once gloo no
// longer touches the caller's buffer. A timed-out gloo group is unusable (gloo poisons its
// context): later calls fail at once with the same kind.
//
// Failure. fail() records the first failure, wakes the waiting call, aborts a pending send/recv
// and writes the job-wide flag: the first writer's kind and message (compareSet on an absent
// key), then a counter that waits poll. A call that sees the flag fails with the recorded kind,
// as the Python engines of _inter do (a mismatch on one host is a MismatchError on all; the
// multi-host communicator raises what the engine returns). gloo cannot cancel a collective in
// flight (2.13's ProcessGroupGloo has no abort()): a call that gives up on one returns while
// gloo may still hold the buffer until its timeout or until the peers exit; the group is dead
// by then, and release() hands its last references to a thread of their own so that it never
// blocks on gloo.
#include <ATen/ATen.h>
#include <torch/python.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bindings/capi.h"
#include "hier/engine.h"
#include "torch/backend.h"
#include "torch/engines.h"

namespace plait_torch {
namespace {

using Secs = std::chrono::duration<double>;
constexpr double kFlagEvery = 0.05;  // seconds of waiting between looks at the job-wide flag
constexpr int64_t kMarginMs = 100;   // gloo's own timeout ends this long after plait's deadline
constexpr double kGraceS = 2.0;      // how long a call that gave up waits for gloo to let go
const char* const kGlooIoException = "N4gloo11IoExceptionE";  // typeid(gloo::IoException).name()
const char* const kFlagKey = "plait/engine-abort";
const char* const kFlagMsgKey = "plait/engine-abort/msg";
// The header every send starts with (see above); payloads up to kInline bytes ride inside it.
constexpr int kHeaderTag = 0x7fffffff;
constexpr uint32_t kHeaderMagic = 0x706c6870;  // "plhp"
constexpr size_t kHeaderBytes = 256, kHeadBytes = 16, kInline = kHeaderBytes - kHeadBytes;
// How long the inbox's receive waits in gloo: gloo poisons a context whose receive times out, so
// this is never meant to pass; a group idle this long stops taking messages (recv says why).
constexpr std::chrono::hours kInboxWait(24 * 30);
struct Head {
  uint32_t magic;
  int32_t tag;
  uint64_t bytes;
};
static_assert(sizeof(Head) == kHeadBytes, "header layout");

double now_s() { return Secs(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void say(char* err, size_t errlen, const std::string& s) {
  if (err != nullptr && errlen > 0) std::snprintf(err, errlen, "%s", s.c_str());
}

std::string first_line(const char* s) {
  std::string t(s);
  return t.substr(0, t.find('\n'));
}

const char* const kTypeNames[] = {"float16", "bfloat16", "float32", "float64", "int8",
                                  "uint8",   "int32",    "int64",   "bool"};

bool scalar_type(uint8_t d, at::ScalarType* t) {
  static const at::ScalarType kTypes[] = {at::kHalf,   at::kBFloat16, at::kFloat,
                                          at::kDouble, at::kChar,     at::kByte,
                                          at::kInt,    at::kLong,     at::kBool};
  if (d >= sizeof(kTypes) / sizeof(kTypes[0])) return false;
  *t = kTypes[d];
  return true;
}

const char* op_name(uint8_t op) {
  static const char* kNames[] = {"sum", "prod", "min", "max", "avg"};
  return op < 5 ? kNames[op] : "?";
}

// One op's end, signalled by gloo's thread (a Future callback) or by the send/recv helper.
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  std::atomic<bool> ready{false};
  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      error = std::move(e);
      done = true;
    }
    ready.store(true, std::memory_order_release);
    cv.notify_all();
  }
};

// An op in flight (what allgather_start hands out as its request).
struct Pending {
  c10::intrusive_ptr<c10d::Work> work;
  std::shared_ptr<Waiter> w;
  std::string what;
  bool p2p = false;
};

// The waiters of send/recv transfers (send, recv and p2p_start's). A gloo send or recv ends
// only inside Work::wait(), so every Work in flight gets a thread of its own waiting there (the
// pool grows to the number in flight and keeps idle threads for the next ones): never a line, in
// which a receive that waits long would hold back the end of a send started after it. Shared with
// its threads.
struct WaitPool : std::enable_shared_from_this<WaitPool> {
  struct Job {
    c10::intrusive_ptr<c10d::Work> work;
    std::shared_ptr<Waiter> w;
    std::chrono::milliseconds timeout;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> jobs;
  std::vector<c10::intrusive_ptr<c10d::Work>> running;
  std::vector<std::thread> threads;
  int idle = 0;
  bool stop = false;

  void push(Job j) {
    std::lock_guard<std::mutex> lk(mu);
    jobs.push_back(std::move(j));
    if (idle > int(jobs.size()) - 1) {
      cv.notify_one();
    } else {
      threads.emplace_back([self = shared_from_this()] { self->loop(); });
    }
  }
  void loop() {
    for (;;) {
      Job j;
      {
        std::unique_lock<std::mutex> lk(mu);
        ++idle;
        cv.wait(lk, [&] { return stop || !jobs.empty(); });
        --idle;
        if (jobs.empty()) return;
        j = std::move(jobs.front());
        jobs.pop_front();
        running.push_back(j.work);
      }
      std::exception_ptr e;
      try {
        if (!j.work->wait(j.timeout)) e = std::make_exception_ptr(std::runtime_error("aborted"));
      } catch (...) {
        e = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        running.erase(std::find(running.begin(), running.end(), j.work));
      }
      j.w->finish(e);
    }
  }
  // Every Work queued or waited for returns from its wait (gloo's send/recv waits end on abort).
  void abort_all() {
    std::lock_guard<std::mutex> lk(mu);
    try {
      for (auto& j : jobs) j.work->abort();
      for (auto& w : running) w->abort();
    } catch (const std::exception&) {
    }
  }
  // At release: the threads end once their waits do (detach: gloo still holds a buffer).
  void close(bool detach) {
    std::vector<std::thread> ts;
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
      ts.swap(threads);
    }
    cv.notify_all();
    for (auto& t : ts) detach ? t.detach() : t.join();
  }
};

// One p2p_start transfer. A send is its header and, past kInline bytes, its payload, both issued
// at once; a receive first waits for its header (kHeader), in start order among the receives of
// its (peer, tag), then copies an inline payload or posts the payload's receive (kPosted).
struct P2pReq {
  enum State { kHeader, kPosted, kDone };
  bool send;
  int peer, tag;
  void* buf;
  size_t bytes;
  double deadline, timeout_s;
  std::string what;
  State state = kPosted;
  Pending hp, pp;            // the header's send, the payload's send or receive
  uint32_t kind = PLAIT_OK;  // kDone: its outcome
  std::string msg;           // and the message of a failure
};

// Headers that arrived, in arrival order, and the threads that receive them (see above): one per
// other member, each keeping one named receive of that member's headers posted, so that gloo has
// told the member "ready" before it sends and a header crosses in one hop, not three (a
// receive from any member announces nothing: the sender would first ask, then wait for the
// answer). One (member, tag) pair's headers are queued in their order.
struct Inbox {
  struct Arrival {
    int src, tag;
    uint64_t bytes;
    std::vector<uint8_t> data;  // the payload when it came inline
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Arrival> q;
  std::vector<c10::intrusive_ptr<c10d::Work>> posted;  // per member: the receive gloo holds now
  std::vector<std::string> ended;  // per member: why its receiving ended ("" while it runs)
  bool stop = false;

  // The first queued header of tag from src (-1: any member); q.end() if none.
  std::deque<Arrival>::iterator find(int src, int tag) {
    return std::find_if(q.begin(), q.end(), [&](const Arrival& a) {
      return a.tag == tag && (src < 0 || a.src == src);
    });
  }
  // Why nothing more can come from src (-1: from any member: every one's receiving ended), or "".
  std::string closed(int src) const {
    if (src >= 0) return ended[size_t(src)];
    std::string why;
    for (const auto& e : ended) {
      if (e == "-") continue;
      if (e.empty()) return "";
      why = e;
    }
    return why;
  }

  void loop(const c10::intrusive_ptr<c10d::Backend>& pg, int src) {
    std::string why;
    for (;;) {
      std::vector<at::Tensor> ts{at::empty({int64_t(kHeaderBytes)}, at::kByte)};
      c10::intrusive_ptr<c10d::Work> w;
      try {  // outside the lock: posting may wait for the member's connection
        w = pg->recv(ts, src, kHeaderTag);
      } catch (const std::exception& e) {
        why = first_line(e.what());
        break;
      }
      {
        std::lock_guard<std::mutex> lk(mu);
        if (stop) {  // release() came meanwhile and did not see this receive
          w->abort();
          break;
        }
        posted[size_t(src)] = w;
      }
      bool got = false;
      try {
        got = w->wait(kInboxWait);
        if (!got) why = "its receive was aborted";
      } catch (const std::exception& e) {
        why = first_line(e.what());
      }
      std::lock_guard<std::mutex> lk(mu);
      posted[size_t(src)].reset();
      if (!got) break;
      Head h;
      const uint8_t* p = ts[0].data_ptr<uint8_t>();
      std::memcpy(&h, p, sizeof h);
      if (h.magic != kHeaderMagic || h.tag < 0) {
        why = "member " + std::to_string(src) + " sent a garbled message header";
        break;
      }
      Arrival a{src, h.tag, h.bytes, {}};
      if (h.bytes <= kInline) a.data.assign(p + kHeadBytes, p + kHeadBytes + h.bytes);
      q.push_back(std::move(a));
      cv.notify_all();
    }
    std::lock_guard<std::mutex> lk(mu);
    ended[size_t(src)] =
        stop ? "stopped"
             : "no more messages from member " + std::to_string(src) + " can arrive: " + why;
    cv.notify_all();
  }
};

class Gloo {
 public:
  Gloo(c10::intrusive_ptr<c10d::Backend> pg, c10::intrusive_ptr<c10d::Store> store,
       std::string label)
      : pg_(std::move(pg)), store_(std::move(store)), label_(std::move(label)) {
    rank_ = pg_->getRank();
    size_ = pg_->getSize();
    // 100 us: bench/gloo_engine.py at 8 B, 0 / 100 / 1000 us of spin took 1.01 / 0.44 / 0.52x
    // the time of torch's own wait on the same gloo (bench/RESULTS-hier.md, 2026-12-05).
    const char* spin = std::getenv("PLAIT_ENGINE_SPIN_US");
    spin_s_ = (spin != nullptr && *spin != '\0') ? std::atof(spin) * 1e-6 : 100e-6;
    pool_ = std::make_shared<WaitPool>();
    inbox_ = std::make_shared<Inbox>();
    const char* probe = std::getenv("PLAIT_GLOO_PROBE");
    headers_ = !(probe != nullptr && std::string(probe) == "0");
  }
  ~Gloo();

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Whether send/recv carry the header (and probe works); PLAIT_GLOO_PROBE=0: plain named
  // transfers, no probe. Every member must agree (make_gloo_engine checks).
  bool headers() const { return headers_; }
  plait_engine table{};  // what the capsule holds; freed with the group
  uint32_t allreduce(void* buf, size_t count, uint8_t dtype, uint8_t op, double timeout_s,
                     char* err, size_t errlen);
  uint32_t allreduce_start(void* buf, size_t count, uint8_t dtype, uint8_t op, double timeout_s,
                           void** req, char* err, size_t errlen);
  uint32_t allgather_start(const void* in, void* out, size_t bytes, void** req, char* err,
                           size_t errlen);
  uint32_t wait(void* req, double timeout_s, char* err, size_t errlen);
  uint32_t broadcast(void* buf, size_t bytes, int root, double timeout_s, char* err, size_t errlen);
  uint32_t alltoall(const void* in, void* out, size_t bytes, double timeout_s, char* err,
                    size_t errlen);
  uint32_t send(const void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
                size_t errlen);
  uint32_t recv(void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
                size_t errlen);
  uint32_t probe(int tag, int* src, size_t* bytes, char* err, size_t errlen);
  // engine.h's p2p_start / p2p_test: several sends and receives in flight at once.
  uint32_t p2p_start(bool send, void* buf, size_t bytes, int peer, int tag, double timeout_s,
                     void** req, char* err, size_t errlen);
  uint32_t p2p_test(void* req, int* done, char* err, size_t errlen);
  void fail(uint32_t kind, const char* msg);
  // One named transfer, no header (PLAIT_GLOO_PROBE=0).
  uint32_t direct(bool send, void* buf, size_t bytes, int peer, int tag, double timeout_s,
                  const std::string& what, char* err, size_t errlen);

 private:
  std::string where(const std::string& what) const {
    return "gloo " + what + " on group '" + label_ + "' (rank " + std::to_string(rank_) + " of " +
           std::to_string(size_) + ")";
  }
  // Nonzero (and the message) when the group is dead: failed, flagged or timed out before.
  uint32_t dead(const std::string& what, char* err, size_t errlen);
  // Records the group's first death; true if this one was it.
  bool die(uint32_t kind, const std::string& msg);
  // The job-wide flag: 0 not set, 1 set (kind and msg: the first failure's), 2 the store is
  // unreachable (kind PEER_LOST, msg: so).
  int flag(uint32_t* kind, std::string* msg);
  void write_flag(uint32_t kind, const std::string& msg);
  static std::chrono::milliseconds gloo_timeout(double timeout_s) {
    if (std::isinf(timeout_s)) return c10d::kUnsetTimeout;
    return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(timeout_s * 1e3)) + kMarginMs);
  }
  uint32_t issue(const std::string& what, const std::function<c10::intrusive_ptr<c10d::Work>()>& f,
                 Pending* p, char* err, size_t errlen);
  // One gloo send or recv of t, as the wire format above uses them: start issues it, wait hands
  // it to a pool thread and finishes it (every started one is waited).
  uint32_t transfer_start(bool send, const at::Tensor& t, int peer, int tag,
                          const std::string& what, Pending* p, char* err, size_t errlen);
  uint32_t transfer_wait(Pending& p, double timeout_s, char* err, size_t errlen);
  // A started send/recv's Work to a pool thread, which waits for it (gloo's own timeout from
  // timeout_s) and signals p's Waiter.
  void hand_over(const Pending& p, double timeout_s);
  void start_inbox();
  // Checks a send/recv's peer and tag; starts the inbox on the group's first one.
  uint32_t check_p2p(int peer, int tag, const std::string& what, char* err, size_t errlen);
  uint32_t lost(const std::string& what, const std::string& why, char* err, size_t errlen);
  // Waits for the first queued header of (peer, tag) and takes it off the queue.
  uint32_t take(int peer, int tag, double timeout_s, const std::string& what, Inbox::Arrival* a,
                char* err, size_t errlen);
  uint32_t finish(Pending& p, double timeout_s, char* err, size_t errlen);
  uint32_t failed(Pending& p, bool late, char* err, size_t errlen);
  // p2p_start's transfers: issued, handed to the wait pool; receives wait for their header in
  // start order per (peer, tag) (order_), and take it when it is their turn.
  uint32_t post(bool send, const at::Tensor& t, int peer, int tag, const std::string& what,
                double timeout_s, Pending* p, char* err, size_t errlen);
  void take_headers(int peer, int tag);
  uint32_t finished(P2pReq* r, uint32_t kind, char* err, size_t errlen);
  at::Tensor view(const void* p, size_t n, at::ScalarType t = at::kByte) const {
    return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(n)},
                         at::TensorOptions().dtype(t));
  }

  c10::intrusive_ptr<c10d::Backend> pg_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string label_;
  int rank_ = 0, size_ = 1;
  double spin_s_ = 0;
  std::shared_ptr<Inbox> inbox_;
  std::vector<std::thread> inbox_threads_;  // started by the first send, recv or probe
  std::shared_ptr<WaitPool> pool_;          // the send/recv transfers' waiters
  std::map<std::pair<int, int>, std::deque<P2pReq*>> order_;  // receives awaiting a header
  std::set<P2pReq*> live_;                                    // started, not yet finished
  bool stuck_ = false;  // an op was given up on while gloo still ran it

  std::mutex mu_;  // guards the fields below
  std::atomic<bool> dead_{false};
  uint32_t dead_kind_ = PLAIT_OK;
  std::string dead_msg_;
  std::shared_ptr<Waiter> current_;  // the op a call waits on now (fail() wakes it)
  std::atomic<bool> flag_written_{false};
  double next_probe_flag_ = 0;  // when probe() next looks at the job-wide flag
  bool headers_ = true;
};

Gloo::~Gloo() {
  if (!inbox_threads_.empty()) {
    std::vector<c10::intrusive_ptr<c10d::Work>> posted;
    {
      std::lock_guard<std::mutex> lk(inbox_->mu);
      inbox_->stop = true;
      posted = inbox_->posted;
    }
    for (auto& w : posted) {
      try {
        if (w) w->abort();  // its wait returns; the Work (and the tensor) go with it
      } catch (const std::exception&) {
      }
    }
    for (auto& t : inbox_threads_) t.join();
  }
  if (!live_.empty()) pool_->abort_all();  // requests never finished: gloo lets go of them
  // A thread still in a wait stays with gloo until gloo's timeout; its state is its own.
  pool_->close(stuck_ || !live_.empty());
  for (P2pReq* r : live_) delete r;
  if (stuck_)  // ~ProcessGroupGloo waits for the ops it runs: drop the last references elsewhere
    std::thread([pg = std::move(pg_), st = std::move(store_)]() mutable {
      pg.reset();
      st.reset();
    }).detach();
}

bool Gloo::die(uint32_t kind, const std::string& msg) {
  std::lock_guard<std::mutex> lk(mu_);
  if (dead_.load()) return false;
  dead_kind_ = kind;
  dead_msg_ = msg;
  dead_.store(true, std::memory_order_release);
  return true;
}

uint32_t Gloo::dead(const std::string& what, char* err, size_t errlen) {
  if (!dead_.load(std::memory_order_acquire)) return PLAIT_OK;
  std::lock_guard<std::mutex> lk(mu_);
  say(err, errlen, where(what) + ": " + dead_msg_);
  return dead_kind_;
}

int Gloo::flag(uint32_t* kind, std::string* msg) {
  *kind = PLAIT_E_PEER_LOST;
  try {
    if (store_->add(kFlagKey, 0) <= 0) return 0;
    std::vector<uint8_t> v = store_->get(kFlagMsgKey);
    std::string s(v.begin(), v.end());  // "kind|message"
    const size_t bar = s.find('|');
    const long k =
        bar == std::string::npos ? 0 : std::strtol(s.substr(0, bar).c_str(), nullptr, 10);
    if (k >= PLAIT_E_GENERIC && k <= PLAIT_E_PEER_LOST) *kind = uint32_t(k);
    *msg = bar == std::string::npos ? s : s.substr(bar + 1);
    return 1;
  } catch (const std::exception& e) {
    *msg = "the store holding the job-wide abort flag is unreachable (" + first_line(e.what()) +
           "); the rank serving it is probably gone";
    return 2;
  }
}

void Gloo::write_flag(uint32_t kind, const std::string& msg) {
  if (flag_written_.exchange(true)) return;
  std::string value = std::to_string(kind) + "|" + msg;
  auto landed = std::make_shared<std::promise<void>>();
  std::future<void> f = landed->get_future();
  // On a thread of its own: a dead store blocks for its whole timeout, fail() waits 2 s at most.
  std::thread([st = store_, value, landed] {
    try {
      st->compareSet(kFlagMsgKey, std::vector<uint8_t>(),
                     std::vector<uint8_t>(value.begin(), value.end()));
      st->add(kFlagKey, 1);
    } catch (const std::exception&) {  // the store is gone too: the peers see that instead
    }
    landed->set_value();
  }).detach();
  f.wait_for(std::chrono::seconds(2));
}

void Gloo::fail(uint32_t kind, const char* msg) {
  std::string text = msg != nullptr ? msg : "";
  if (text.rfind("rank ", 0) != 0) text = "rank " + std::to_string(rank_) + " failed: " + text;
  die(kind == PLAIT_OK ? PLAIT_E_GENERIC : kind, text);
  std::shared_ptr<Waiter> w;
  {
    std::lock_guard<std::mutex> lk(mu_);
    w = current_;
  }
  if (w) {
    std::lock_guard<std::mutex> lk(w->mu);  // the waiter looks at dead_ under this lock
    w->cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lk(inbox_->mu);  // a recv waiting for its header
    inbox_->cv.notify_all();
  }
  pool_->abort_all();  // send/recv transfers: gloo's waits end on abort, the calls report it
  try {
    pg_->abort();  // a no-op for 2.13's gloo; a later torch may end collectives too
  } catch (const std::exception&) {
  }
  write_flag(kind == PLAIT_OK ? PLAIT_E_GENERIC : kind, text);
}

uint32_t Gloo::issue(const std::string& what,
                     const std::function<c10::intrusive_ptr<c10d::Work>()>& f, Pending* p,
                     char* err, size_t errlen) {
  if (uint32_t k = dead(what, err, errlen)) return k;
  p->what = what;
  p->w = std::make_shared<Waiter>();
  try {
    p->work = f();
  } catch (const std::exception& e) {  // gloo refused the arguments before sending anything
    say(err, errlen, where(what) + ": " + first_line(e.what()));
    return PLAIT_E_INVALID;
  }
  if (!p->p2p) {
    std::shared_ptr<Waiter> w = p->w;
    p->work->getFuture()->addCallback([w](c10::ivalue::Future& fut) {
      w->finish(fut.hasError() ? fut.exception_ptr() : nullptr);
    });
  }
  return PLAIT_OK;
}

uint32_t Gloo::finish(Pending& p, double timeout_s, char* err, size_t errlen) {
  Waiter& w = *p.w;
  const double start = now_s();
  const double deadline = start + timeout_s;  // inf stays inf
  while (!w.ready.load(std::memory_order_acquire) && now_s() - start < spin_s_)
    std::this_thread::yield();
  {
    std::lock_guard<std::mutex> lk(mu_);
    current_ = p.w;
  }
  uint32_t kind = PLAIT_OK;
  bool expired = false;  // this call's own deadline (not a failure elsewhere)
  std::string why;
  double next_flag = start + kFlagEvery;
  std::unique_lock<std::mutex> lk(w.mu);
  while (!w.done) {
    if (dead_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> g(mu_);
      kind = dead_kind_;
      why = dead_msg_;
      break;
    }
    double t = now_s();
    if (t >= deadline) {
      kind = PLAIT_E_TIMEOUT;
      expired = true;
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.3g", timeout_s);
      why = std::string("deadline passed (") + secs + " s) waiting for the group's other members";
      break;
    }
    if (t >= next_flag) {
      lk.unlock();
      uint32_t flagged;
      const bool set = flag(&flagged, &why) != 0;
      lk.lock();
      if (set) {
        kind = flagged;
        break;
      }
      next_flag = now_s() + kFlagEvery;
      continue;
    }
    w.cv.wait_for(lk, Secs(std::min(deadline, next_flag) - t));
  }
  lk.unlock();
  {
    std::lock_guard<std::mutex> g(mu_);
    current_.reset();
  }
  if (kind != PLAIT_OK) {
    // Given up: gloo ends the op itself at its own timeout (just after ours), or at once for an
    // aborted send/recv. Wait for that, so the caller's buffer is free when this returns.
    if (p.p2p) p.work->abort();
    double grace = expired ? kMarginMs * 1e-3 + kGraceS : p.p2p ? kGraceS : 0.0;
    std::unique_lock<std::mutex> g(w.mu);
    if (!w.cv.wait_for(g, Secs(grace), [&] { return w.done; })) stuck_ = true;
    if (expired && w.done && !w.error) return PLAIT_OK;  // late, but complete
    if (expired) {
      die(kind, "an earlier " + p.what + " timed out: the group is unusable");
    } else {
      die(kind, why);  // a failure here or elsewhere: later calls fail at once
    }
    say(err, errlen, where(p.what) + ": " + why);
    return kind;
  }
  if (!w.error) return PLAIT_OK;
  return failed(p, now_s() >= deadline, err, errlen);
}

// gloo's failures, by type: after plait's deadline (late), gloo's own timeout; before it, a lost
// or closed connection (torch's DistError family, or gloo's IoException, which torch passes on as
// it is: without gloo's headers its type is known by name only). Anything else is a bug.
uint32_t Gloo::failed(Pending& p, bool late, char* err, size_t errlen) {
  Waiter& w = *p.w;
  std::string why;
  uint32_t kind;
  uint32_t flagged;
  if (flag(&flagged, &why) == 1) {  // the cause, where a peer failed first and closed its pairs
    die(flagged, why);
    say(err, errlen, where(p.what) + ": " + why);
    return flagged;
  }
  kind = late ? PLAIT_E_TIMEOUT : PLAIT_E_PEER_LOST;
  try {
    std::rethrow_exception(w.error);
  } catch (const c10::DistError& e) {
    why = first_line(e.what_without_backtrace());
  } catch (const std::exception& e) {
    const std::type_info* t = abi::__cxa_current_exception_type();
    why = first_line(e.what());
    if (!late && (t == nullptr || std::strcmp(t->name(), kGlooIoException) != 0))
      kind = PLAIT_E_GENERIC;
  }
  die(kind, "an earlier " + p.what + " failed: " + why);
  say(err, errlen, where(p.what) + ": " + why);
  return kind;
}

uint32_t Gloo::allreduce(void* buf, size_t count, uint8_t dtype, uint8_t op, double timeout_s,
                         char* err, size_t errlen) {
  void* req = nullptr;
  if (uint32_t k = allreduce_start(buf, count, dtype, op, timeout_s, &req, err, errlen)) return k;
  return wait(req, timeout_s, err, errlen);
}

// Issues the op and returns at once: gloo runs it on its own threads and the Future's callback
// marks it done; wait() (finish) holds plait's deadline and the flag, as a blocking call does.
uint32_t Gloo::allreduce_start(void* buf, size_t count, uint8_t dtype, uint8_t op, double timeout_s,
                               void** req, char* err, size_t errlen) {
  *req = nullptr;
  at::ScalarType t;
  std::string what = "allreduce";
  if (!scalar_type(dtype, &t) || op > PLAIT_MAX) {
    say(err, errlen,
        where(what) + ": dtype code " + std::to_string(dtype) + " with op " + op_name(op) +
            " is not one gloo reduces (supports() says which)");
    return PLAIT_E_INVALID;
  }
  what += " of " + std::to_string(count) + " " + kTypeNames[dtype] + " (" + op_name(op) + ")";
  auto p = std::make_unique<Pending>();
  if (count == 0 || size_ == 1) {
    if (uint32_t k = dead(what, err, errlen)) return k;
    p->what = what;  // no work: wait() finds it finished
    *req = p.release();
    return PLAIT_OK;
  }
  static const c10d::ReduceOp::RedOpType kOps[] = {c10d::ReduceOp::SUM, c10d::ReduceOp::PRODUCT,
                                                   c10d::ReduceOp::MIN, c10d::ReduceOp::MAX};
  if (t == at::kBool) {  // gloo adds bools as bytes (1 + 1 = a bool byte of 2): or / and instead
    t = at::kByte;
    op = (op == PLAIT_SUM || op == PLAIT_MAX) ? PLAIT_MAX : PLAIT_MIN;
  }
  std::vector<at::Tensor> ts{view(buf, count, t)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(kOps[op]);
  o.timeout = gloo_timeout(timeout_s);
  if (uint32_t k = issue(what, [&] { return pg_->allreduce(ts, o); }, p.get(), err, errlen))
    return k;
  *req = p.release();
  return PLAIT_OK;
}

uint32_t Gloo::allgather_start(const void* in, void* out, size_t bytes, void** req, char* err,
                               size_t errlen) {
  *req = nullptr;
  auto p = std::make_unique<Pending>();
  std::string what = "allgather of " + std::to_string(bytes) + " B";
  if (bytes == 0 || size_ == 1) {
    if (bytes != 0) std::memcpy(out, in, bytes);
    if (uint32_t k = dead(what, err, errlen)) return k;
    p->what = what;  // no work: wait() finds it finished
    *req = p.release();
    return PLAIT_OK;
  }
  at::Tensor o = view(out, bytes * size_), i = view(in, bytes);
  c10d::AllgatherOptions opts;  // gloo's default timeout: wait() holds plait's deadline
  if (uint32_t k =
          issue(what, [&] { return pg_->_allgather_base(o, i, opts); }, p.get(), err, errlen))
    return k;
  *req = p.release();
  return PLAIT_OK;
}

uint32_t Gloo::wait(void* req, double timeout_s, char* err, size_t errlen) {
  std::unique_ptr<Pending> p(static_cast<Pending*>(req));
  if (!p->work) return dead(p->what, err, errlen);
  return finish(*p, timeout_s, err, errlen);
}

uint32_t Gloo::broadcast(void* buf, size_t bytes, int root, double timeout_s, char* err,
                         size_t errlen) {
  std::string what = "broadcast of " + std::to_string(bytes) + " B from " + std::to_string(root);
  if (root < 0 || root >= size_) {
    say(err, errlen, where(what) + ": root " + std::to_string(root) + " is not a member");
    return PLAIT_E_INVALID;
  }
  if (bytes == 0 || size_ == 1) return dead(what, err, errlen);
  Pending p;
  std::vector<at::Tensor> ts{view(buf, bytes)};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = gloo_timeout(timeout_s);
  if (uint32_t k = issue(what, [&] { return pg_->broadcast(ts, o); }, &p, err, errlen)) return k;
  return finish(p, timeout_s, err, errlen);
}

uint32_t Gloo::alltoall(const void* in, void* out, size_t bytes, double timeout_s, char* err,
                        size_t errlen) {
  std::string what = "alltoall of " + std::to_string(bytes) + " B a block";
  if (bytes == 0 || size_ == 1) {
    if (bytes != 0) std::memcpy(out, in, bytes);
    return dead(what, err, errlen);
  }
  Pending p;
  at::Tensor o = view(out, bytes * size_), i = view(in, bytes * size_);
  c10d::AllToAllOptions opts;
  opts.timeout = gloo_timeout(timeout_s);
  std::vector<int64_t> even;
  if (uint32_t k =
          issue(what, [&] { return pg_->alltoall_base(o, i, even, even, opts); }, &p, err, errlen))
    return k;
  return finish(p, timeout_s, err, errlen);
}

uint32_t Gloo::check_p2p(int peer, int tag, const std::string& what, char* err, size_t errlen) {
  if (peer < 0 || peer >= size_ || peer == rank_ || tag < 0 || tag >= kHeaderTag) {
    say(err, errlen,
        where(what) +
            ": the peer must be another member and the tag in [0, 2^31 - 1) (2^31 - 1 "
            "carries the engine's message headers)");
    return PLAIT_E_INVALID;
  }
  if (uint32_t k = dead(what, err, errlen)) return k;
  if (headers_) start_inbox();
  return PLAIT_OK;
}

void Gloo::start_inbox() {
  if (!inbox_threads_.empty()) return;
  {
    std::lock_guard<std::mutex> lk(inbox_->mu);
    inbox_->posted.resize(size_t(size_));
    inbox_->ended.assign(size_t(size_), "");
    inbox_->ended[size_t(rank_)] = "-";  // never a sender to itself
  }
  for (int m = 0; m < size_; ++m)
    if (m != rank_) inbox_threads_.emplace_back([in = inbox_, pg = pg_, m] { in->loop(pg, m); });
}

uint32_t Gloo::transfer_start(bool send, const at::Tensor& t, int peer, int tag,
                              const std::string& what, Pending* p, char* err, size_t errlen) {
  p->p2p = true;
  std::vector<at::Tensor> ts{t};
  return issue(
      what, [&] { return send ? pg_->send(ts, peer, tag) : pg_->recv(ts, peer, tag); }, p, err,
      errlen);
}

void Gloo::hand_over(const Pending& p, double timeout_s) {
  pool_->push({p.work, p.w, std::isinf(timeout_s) ? ::kNoTimeout : gloo_timeout(timeout_s)});
}

uint32_t Gloo::transfer_wait(Pending& p, double timeout_s, char* err, size_t errlen) {
  hand_over(p, timeout_s);
  if (dead_.load()) p.work->abort();  // fail() came between issue and now
  return finish(p, timeout_s, err, errlen);
}

// The header, then the payload unless it rode inside: both are issued before either is waited
// for, so a large message costs one rendezvous with the receiver, not two in a row.
uint32_t Gloo::send(const void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
                    size_t errlen) {
  const std::string what = "send of " + std::to_string(bytes) + " B to " + std::to_string(peer) +
                           " (tag " + std::to_string(tag) + ")";
  if (uint32_t k = check_p2p(peer, tag, what, err, errlen)) return k;
  if (!headers_)
    return direct(true, const_cast<void*>(buf), bytes, peer, tag, timeout_s, what, err, errlen);
  const bool inline_ = bytes <= kInline;
  // Owned by the Work while gloo holds it: a send given up on leaves gloo no freed memory.
  at::Tensor h = at::empty({int64_t(kHeadBytes + (inline_ ? bytes : 0))}, at::kByte);
  const Head head{kHeaderMagic, tag, uint64_t(bytes)};
  std::memcpy(h.data_ptr<uint8_t>(), &head, sizeof head);
  if (inline_ && bytes) std::memcpy(h.data_ptr<uint8_t>() + kHeadBytes, buf, bytes);
  const double start = now_s();
  Pending hp, pp;
  if (uint32_t k = transfer_start(true, h, peer, kHeaderTag, what, &hp, err, errlen)) return k;
  uint32_t k = inline_ ? PLAIT_OK
                       : transfer_start(true, view(buf, bytes), peer, tag, what, &pp, err, errlen);
  const uint32_t kh = transfer_wait(hp, timeout_s, k ? nullptr : err, k ? 0 : errlen);
  if (!k) k = kh;
  if (!pp.work) return k;
  if (k) {  // the header failed: the payload's send must let go of the caller's buffer too
    char ignored[8];
    transfer_wait(pp, 0.0, ignored, sizeof ignored);
    return k;
  }
  return transfer_wait(pp, std::max(0.0, timeout_s - (now_s() - start)), err, errlen);
}

uint32_t Gloo::direct(bool send, void* buf, size_t bytes, int peer, int tag, double timeout_s,
                      const std::string& what, char* err, size_t errlen) {
  Pending p;
  if (uint32_t k = transfer_start(send, view(buf, bytes), peer, tag, what, &p, err, errlen))
    return k;
  return transfer_wait(p, timeout_s, err, errlen);
}

// A member's connection closed: the job-wide flag's failure where one was recorded (the member
// failed first, then exited), else a lost peer.
uint32_t Gloo::lost(const std::string& what, const std::string& why, char* err, size_t errlen) {
  uint32_t kind;
  std::string cause;
  if (flag(&kind, &cause) == 1) {
    die(kind, cause);
    say(err, errlen, where(what) + ": " + cause);
    return kind;
  }
  die(PLAIT_E_PEER_LOST, why);
  say(err, errlen, where(what) + ": " + why);
  return PLAIT_E_PEER_LOST;
}

uint32_t Gloo::take(int peer, int tag, double timeout_s, const std::string& what, Inbox::Arrival* a,
                    char* err, size_t errlen) {
  const double start = now_s(), deadline = start + timeout_s;
  double next_flag = start + kFlagEvery;
  Inbox& in = *inbox_;
  // A message on its way lands within microseconds: look (yielding) before sleeping, as finish()
  // does, so the common case costs no wake-up of this thread.
  for (double t = start; t - start < spin_s_; t = now_s()) {
    {
      std::lock_guard<std::mutex> g(in.mu);
      if (!in.q.empty() && in.find(peer, tag) != in.q.end()) break;
    }
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lk(in.mu);
  for (;;) {
    auto got = in.find(peer, tag);
    if (got != in.q.end()) {
      *a = std::move(*got);
      in.q.erase(got);
      return PLAIT_OK;
    }
    if (dead_.load(std::memory_order_acquire)) {
      lk.unlock();
      return dead(what, err, errlen);
    }
    if (const std::string why = in.closed(peer); !why.empty()) {
      lk.unlock();
      return lost(what, why, err, errlen);
    }
    const double t = now_s();
    if (t >= deadline) {
      lk.unlock();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.3g", timeout_s);
      say(err, errlen,
          where(what) + ": deadline passed (" + secs + " s) waiting for the member's message");
      return PLAIT_E_TIMEOUT;  // nothing was posted: the group stays usable
    }
    if (t >= next_flag) {
      lk.unlock();
      uint32_t kind;
      std::string why;
      const bool set = flag(&kind, &why) != 0;
      if (set) {
        die(kind, why);
        say(err, errlen, where(what) + ": " + why);
        return kind;
      }
      lk.lock();
      next_flag = now_s() + kFlagEvery;
      continue;
    }
    in.cv.wait_for(lk, Secs(std::min(deadline, next_flag) - t));
  }
}

uint32_t Gloo::recv(void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
                    size_t errlen) {
  const std::string what = "recv of " + std::to_string(bytes) + " B from " + std::to_string(peer) +
                           " (tag " + std::to_string(tag) + ")";
  if (uint32_t k = check_p2p(peer, tag, what, err, errlen)) return k;
  if (!headers_) return direct(false, buf, bytes, peer, tag, timeout_s, what, err, errlen);
  const double start = now_s();
  Inbox::Arrival a;
  if (uint32_t k = take(peer, tag, timeout_s, what, &a, err, errlen)) return k;
  if (a.bytes != bytes) {
    say(err, errlen,
        where(what) + ": mismatched send/recv: member " + std::to_string(peer) + " sent " +
            std::to_string(a.bytes) + " B on this tag");
    return PLAIT_E_MISMATCH;
  }
  if (bytes <= kInline) {
    if (bytes) std::memcpy(buf, a.data.data(), bytes);
    return PLAIT_OK;
  }
  const double left = std::max(0.0, timeout_s - (now_s() - start));
  Pending p;
  if (uint32_t k = transfer_start(false, view(buf, bytes), peer, tag, what, &p, err, errlen))
    return k;
  return transfer_wait(p, left, err, errlen);
}

uint32_t Gloo::probe(int tag, int* src, size_t* bytes, char* err, size_t errlen) {
  *src = -1;
  *bytes = 0;
  const std::string what = "probe of tag " + std::to_string(tag);
  if (tag < 0 || tag >= kHeaderTag) {
    say(err, errlen, where(what) + ": the tag must be in [0, 2^31 - 1)");
    return PLAIT_E_INVALID;
  }
  if (uint32_t k = dead(what, err, errlen)) return k;
  if (size_ == 1) return PLAIT_OK;
  start_inbox();
  std::vector<std::pair<int, int>> waiting;  // started receives take their headers first
  for (const auto& o : order_) waiting.push_back(o.first);
  for (const auto& k : waiting) take_headers(k.first, k.second);
  std::unique_lock<std::mutex> lk(inbox_->mu);
  // A header that a started receive of its (sender, tag) will take is not for this probe.
  std::map<int, size_t> theirs;
  for (const auto& o : order_)
    if (o.first.second == tag) theirs[o.first.first] = o.second.size();
  for (const auto& a : inbox_->q) {
    if (a.tag != tag) continue;
    auto it = theirs.find(a.src);
    if (it != theirs.end() && it->second > 0) {
      --it->second;
      continue;
    }
    *src = a.src;
    *bytes = size_t(a.bytes);
    return PLAIT_OK;
  }
  if (const std::string why = inbox_->closed(-1); !why.empty()) {
    lk.unlock();
    return lost(what, why, err, errlen);
  }
  lk.unlock();
  // Nothing yet: the caller polls, so the job-wide flag is looked at here, every kFlagEvery.
  const double t = now_s();
  if (t >= next_probe_flag_) {
    next_probe_flag_ = t + kFlagEvery;
    uint32_t kind;
    std::string why;
    if (flag(&kind, &why) != 0) {
      die(kind, why);
      say(err, errlen, where(what) + ": " + why);
      return kind;
    }
  }
  return PLAIT_OK;
}

uint32_t Gloo::post(bool send, const at::Tensor& t, int peer, int tag, const std::string& what,
                    double timeout_s, Pending* p, char* err, size_t errlen) {
  if (uint32_t k = transfer_start(send, t, peer, tag, what, p, err, errlen)) return k;
  hand_over(*p, timeout_s);
  return PLAIT_OK;
}

// Hands the queued headers of (peer, tag) to the receives waiting for them, first started first:
// a size that differs ends that receive with a MismatchError (nothing posted: the group stays
// usable); an inline payload is copied; a larger one's receive is posted.
void Gloo::take_headers(int peer, int tag) {
  auto it = order_.find({peer, tag});
  if (it == order_.end()) return;
  std::deque<P2pReq*>& q = it->second;
  while (!q.empty()) {
    P2pReq& r = *q.front();
    Inbox::Arrival a;
    {
      std::lock_guard<std::mutex> lk(inbox_->mu);
      auto got = inbox_->find(peer, tag);
      if (got == inbox_->q.end()) break;
      a = std::move(*got);
      inbox_->q.erase(got);
    }
    q.pop_front();
    if (a.bytes != r.bytes) {
      r.state = P2pReq::kDone;
      r.kind = PLAIT_E_MISMATCH;
      r.msg = where(r.what) + ": mismatched send/recv: member " + std::to_string(peer) + " sent " +
              std::to_string(a.bytes) + " B on this tag";
    } else if (r.bytes <= kInline) {
      if (r.bytes) std::memcpy(r.buf, a.data.data(), r.bytes);
      r.state = P2pReq::kDone;
    } else {
      char err[512] = "";
      const double left = std::max(0.0, r.deadline - now_s());
      if (uint32_t k =
              post(false, view(r.buf, r.bytes), peer, tag, r.what, left, &r.pp, err, sizeof err)) {
        r.state = P2pReq::kDone;
        r.kind = k;
        r.msg = err;
      } else {
        r.state = P2pReq::kPosted;
      }
    }
  }
  if (q.empty()) order_.erase(it);
}

uint32_t Gloo::p2p_start(bool send, void* buf, size_t bytes, int peer, int tag, double timeout_s,
                         void** req, char* err, size_t errlen) {
  *req = nullptr;
  const std::string what = std::string(send ? "send of " : "recv of ") + std::to_string(bytes) +
                           " B " + (send ? "to " : "from ") + std::to_string(peer) + " (tag " +
                           std::to_string(tag) + ")";
  if (uint32_t k = check_p2p(peer, tag, what, err, errlen)) return k;
  auto r = std::make_unique<P2pReq>();
  *r = P2pReq{send, peer, tag, buf, bytes, now_s() + timeout_s, timeout_s, what};
  if (!headers_) {
    if (uint32_t k = post(send, view(buf, bytes), peer, tag, what, timeout_s, &r->pp, err, errlen))
      return k;
  } else if (send) {
    const bool inline_ = bytes <= kInline;
    at::Tensor h = at::empty({int64_t(kHeadBytes + (inline_ ? bytes : 0))}, at::kByte);
    const Head head{kHeaderMagic, tag, uint64_t(bytes)};
    std::memcpy(h.data_ptr<uint8_t>(), &head, sizeof head);
    if (inline_ && bytes) std::memcpy(h.data_ptr<uint8_t>() + kHeadBytes, buf, bytes);
    if (uint32_t k = post(true, h, peer, kHeaderTag, what, timeout_s, &r->hp, err, errlen))
      return k;
    if (!inline_) {
      if (uint32_t k =
              post(true, view(buf, bytes), peer, tag, what, timeout_s, &r->pp, err, errlen)) {
        r->state = P2pReq::kDone;  // the header is out: its wait still ends in p2p_test
        r->kind = k;
        r->msg = err;
      }
    }
  } else {
    r->state = P2pReq::kHeader;
    order_[{peer, tag}].push_back(r.get());
    take_headers(peer, tag);
  }
  live_.insert(r.get());
  *req = r.release();
  return PLAIT_OK;
}

uint32_t Gloo::finished(P2pReq* r, uint32_t kind, char* err, size_t errlen) {
  live_.erase(r);
  if (r->state == P2pReq::kHeader) {  // still waiting for its header: out of the line
    auto it = order_.find({r->peer, r->tag});
    if (it != order_.end()) {
      auto& q = it->second;
      q.erase(std::remove(q.begin(), q.end(), r), q.end());
      if (q.empty()) order_.erase(it);
    }
  }
  delete r;
  return kind;
}

uint32_t Gloo::p2p_test(void* req, int* done, char* err, size_t errlen) {
  *done = 1;
  auto* r = static_cast<P2pReq*>(req);
  if (r == nullptr) return PLAIT_OK;
  *done = 0;
  const double t = now_s();
  if (r->state == P2pReq::kHeader) {
    take_headers(r->peer, r->tag);
    if (r->state == P2pReq::kHeader) {
      uint32_t kind = PLAIT_OK;
      std::string why;
      if (dead_.load(std::memory_order_acquire)) {
        *done = 1;
        return finished(r, dead(r->what, err, errlen), err, errlen);
      }
      {
        std::lock_guard<std::mutex> lk(inbox_->mu);
        why = inbox_->closed(r->peer);
      }
      if (!why.empty()) {
        *done = 1;
        return finished(r, lost(r->what, why, err, errlen), err, errlen);
      }
      if (t >= r->deadline) {  // nothing was posted: the group stays usable
        char secs[32];
        std::snprintf(secs, sizeof secs, "%.3g", r->timeout_s);
        say(err, errlen,
            where(r->what) + ": deadline passed (" + secs + " s) waiting for the member's message");
        *done = 1;
        return finished(r, PLAIT_E_TIMEOUT, err, errlen);
      }
      if (t >= next_probe_flag_) {
        next_probe_flag_ = t + kFlagEvery;
        if (flag(&kind, &why) != 0) {
          die(kind, why);
          say(err, errlen, where(r->what) + ": " + why);
          *done = 1;
          return finished(r, kind, err, errlen);
        }
      }
      return PLAIT_OK;
    }
  }
  // Its Works (a failed or mismatched one included: the header may still be on its way).
  for (Pending* p : {&r->hp, &r->pp}) {
    if (!p->w || p->w->ready.load(std::memory_order_acquire)) continue;
    if (t >= r->deadline + kMarginMs * 1e-3 + kGraceS) {  // gloo's own timeout did not end it
      stuck_ = true;
      die(PLAIT_E_TIMEOUT, "an earlier " + r->what + " timed out: the group is unusable");
      say(err, errlen, where(r->what) + ": deadline passed, and gloo still holds the buffer");
      *done = 1;
      return finished(r, PLAIT_E_TIMEOUT, err, errlen);  // the pool's job keeps the Work
    }
    if (t >= next_probe_flag_) {  // a failure elsewhere: end the transfers, report it next
      next_probe_flag_ = t + kFlagEvery;
      uint32_t kind;
      std::string why;
      if (flag(&kind, &why) != 0 && die(kind, why)) pool_->abort_all();
    }
    return PLAIT_OK;
  }
  *done = 1;
  for (Pending* p : {&r->hp, &r->pp})
    if (p->w && p->w->error)
      return finished(r, failed(*p, now_s() >= r->deadline, err, errlen), err, errlen);
  if (r->kind != PLAIT_OK) say(err, errlen, r->msg);
  return finished(r, r->kind, err, errlen);
}

// The C table: each entry casts ctx back and calls the member; no exception gets out.
template <class F>
uint32_t guarded(char* err, size_t errlen, F f) {
  try {
    return f();
  } catch (const std::exception& e) {
    say(err, errlen, std::string("gloo engine: ") + first_line(e.what()));
    return PLAIT_E_GENERIC;
  }
}

Gloo* G(void* ctx) { return static_cast<Gloo*>(ctx); }

plait_engine* make_table(Gloo* g) {
  plait_engine* e = &g->table;
  e->version = PLAIT_ENGINE_VERSION;
  e->struct_size = sizeof(plait_engine);
  e->name = "gloo";
  e->rank = g->rank();
  e->size = g->size();
  e->ctx = g;
  e->supports = [](void*, uint8_t dtype, uint8_t op) -> int {
    at::ScalarType t;  // 2.13's gloo reduces every plait dtype with sum/prod/min/max
    return scalar_type(dtype, &t) && op <= PLAIT_MAX ? 1 : 0;
  };
  e->allreduce = [](void* c, void* buf, size_t n, uint8_t dt, uint8_t op, double to, char* err,
                    size_t el) {
    return guarded(err, el, [&] { return G(c)->allreduce(buf, n, dt, op, to, err, el); });
  };
  e->allreduce_start = [](void* c, void* buf, size_t n, uint8_t dt, uint8_t op, double to,
                          void** req, char* err, size_t el) {
    return guarded(err, el,
                   [&] { return G(c)->allreduce_start(buf, n, dt, op, to, req, err, el); });
  };
  e->allgather = [](void* c, const void* in, void* out, size_t bytes, double to, char* err,
                    size_t el) {
    return guarded(err, el, [&] {
      void* req = nullptr;
      uint32_t k = G(c)->allgather_start(in, out, bytes, &req, err, el);
      return k != PLAIT_OK ? k : G(c)->wait(req, to, err, el);
    });
  };
  e->allgather_start = [](void* c, const void* in, void* out, size_t bytes, void** req, char* err,
                          size_t el) {
    return guarded(err, el, [&] { return G(c)->allgather_start(in, out, bytes, req, err, el); });
  };
  e->wait = [](void* c, void* req, double to, char* err, size_t el) {
    return guarded(err, el, [&] { return G(c)->wait(req, to, err, el); });
  };
  e->broadcast = [](void* c, void* buf, size_t bytes, int root, double to, char* err, size_t el) {
    return guarded(err, el, [&] { return G(c)->broadcast(buf, bytes, root, to, err, el); });
  };
  e->alltoall = [](void* c, const void* in, void* out, size_t bytes, double to, char* err,
                   size_t el) {
    return guarded(err, el, [&] { return G(c)->alltoall(in, out, bytes, to, err, el); });
  };
  e->send = [](void* c, const void* buf, size_t bytes, int peer, int tag, double to, char* err,
               size_t el) {
    return guarded(err, el, [&] { return G(c)->send(buf, bytes, peer, tag, to, err, el); });
  };
  e->recv = [](void* c, void* buf, size_t bytes, int peer, int tag, double to, char* err,
               size_t el) {
    return guarded(err, el, [&] { return G(c)->recv(buf, bytes, peer, tag, to, err, el); });
  };
  if (g->headers())
    e->probe = [](void* c, int tag, int* src, size_t* bytes, char* err, size_t el) {
      return guarded(err, el, [&] { return G(c)->probe(tag, src, bytes, err, el); });
    };
  e->p2p_start = [](void* c, int send, void* buf, size_t bytes, int peer, int tag, double to,
                    void** req, char* err, size_t el) {
    return guarded(err, el, [&] {
      return G(c)->p2p_start(send != 0, buf, bytes, peer, tag, to, req, err, el);
    });
  };
  e->p2p_test = [](void* c, void* req, int* done, char* err, size_t el) {
    return guarded(err, el, [&] { return G(c)->p2p_test(req, done, err, el); });
  };
  e->fail = [](void* c, uint32_t kind, const char* msg) {
    try {
      G(c)->fail(kind, msg);
    } catch (const std::exception&) {  // out of memory: the flag stays unwritten, nothing else
    }
  };
  e->release = [](void* c) { delete G(c); };
  return e;
}

}  // namespace

void bind_gloo_engine(pybind11::module_& m) {
  m.def(
      "make_gloo_engine",
      [](c10::intrusive_ptr<c10d::Backend> pg, c10::intrusive_ptr<c10d::Store> store,
         const std::string& label) {
        if (!pg || !store) throw std::invalid_argument("make_gloo_engine: pg and store are needed");
        auto* g = new Gloo(std::move(pg), std::move(store), label);
        if (g->size() > 1) {  // PLAIT_GLOO_PROBE must be alike: a header one side does not
          // expect would stall both (one allgather of a byte, at creation)
          const uint8_t mine = g->headers() ? 1 : 0;
          std::vector<uint8_t> all(size_t(g->size()));
          char err[512] = {0};
          void* req = nullptr;
          uint32_t k = g->allgather_start(&mine, all.data(), 1, &req, err, sizeof err);
          if (!k) k = g->wait(req, 300.0, err, sizeof err);
          std::string off;
          for (int r = 0; r < g->size() && !k; ++r)
            if (all[size_t(r)] != mine) off += (off.empty() ? "" : ", ") + std::to_string(r);
          if (k || !off.empty()) {
            const int rank = g->rank();
            delete g;
            if (k) throw Error(k, "gloo engine '" + label + "': " + err);
            throw Error(PLAIT_E_INVALID,
                        "rank " + std::to_string(rank) + ": PLAIT_GLOO_PROBE is " +
                            (mine ? "unset (1)" : "0") + " here but differs on rank(s) " + off +
                            " of gloo group '" + label +
                            "': set it alike on every rank (0: cross-host send/recv without the "
                            "header, and no receive from any rank across hosts)");
          }
        }
        plait_engine* e = make_table(g);
        return pybind11::capsule(e, PLAIT_ENGINE_CAPSULE);
      },
      pybind11::arg("pg"), pybind11::arg("store"), pybind11::arg("label"),
      "An engine between hosts (hier/engine.h) over a ProcessGroupGloo the caller created; its "
      "job-wide abort flag is a key in store. The capsule has no destructor: hand it to one "
      "communicator, which calls release() once.");
}

}  // namespace plait_torch
