#include "core/communicator.h"

#include <signal.h>
#include <unistd.h>

#include <fcntl.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace plait {

namespace {
// "got nan", "got -1": the refused value as the caller wrote it.
std::string bad_seconds(const char* what, double v, const char* zero_means) {
  std::ostringstream m;
  m << what << " must be a number of seconds >= 0 (" << zero_means << "), got " << v;
  return m.str();
}
// The algorithm a shm fingerprint's index stands for (ShmTransport's mismatch reports).
const char* shm_algo_name(Coll c, unsigned index) {
  const auto& algos = algorithms_for(c, kShmCaps);
  return index < algos.size() ? algos[index]->name : "?";
}
}  // namespace

bool Task::wait(std::optional<double> timeout_s) {
  if (timeout_s && !(*timeout_s >= 0))
    throw InvalidArgument(
        bad_seconds("Handle.wait: timeout", *timeout_s, "0 only looks; None waits for the call"));
  if (!done()) {
    start();  // deferred: the progress thread takes it now
    std::unique_lock<std::mutex> lk(m_);
    auto pred = [&] { return done(); };
    if (!timeout_s || std::isinf(*timeout_s)) {
      cv_.wait(lk, pred);
    } else if (!cv_.wait_for(lk, std::chrono::duration<double>(*timeout_s), pred)) {
      return false;
    }
  }
  if (state_.load(std::memory_order_acquire) == 2) throw_error(kind_, msg_, flight_);
  return true;
}

void Task::finish(ErrorKind kind, std::string msg, std::shared_ptr<const std::string> flight) {
  if (kind != ErrorKind::none && reword) msg = reword(kind, msg);
  {
    std::lock_guard<std::mutex> lk(m_);
    kind_ = kind;
    msg_ = std::move(msg);
    flight_ = std::move(flight);
    state_.store(kind == ErrorKind::none ? 1 : 2, std::memory_order_release);
  }
  cv_.notify_all();
  if (on_done_) {
    Done done = std::move(on_done_);
    on_done_ = nullptr;
    done(kind_, msg_);
  }
}

Communicator::Communicator(std::shared_ptr<Segment> seg, int rank, const Options& opt)
    : seg_(std::move(seg)),
      rank_(rank),
      size_(seg_->params().size),
      opt_(opt),
      tp_(*seg_, rank, policy_, shm_algo_name) {
  if (opt_.oversubscribed) policy_.spin_iters = 16;
  try {
    if (!(opt_.timeout_s >= 0))
      throw InvalidArgument(bad_seconds("timeout", opt_.timeout_s, "0: calls never wait"));
    if (!(opt_.init_timeout_s >= 0))
      throw InvalidArgument(
          bad_seconds("init_timeout", opt_.init_timeout_s, "0: init never waits"));
    override_ = AlgoOverride(opt_.algo_override, kShmCaps, /*strict=*/true, "PLAIT_ALGO");
    read_async_policy();
  } catch (const PlaitError& e) {
    // Published in the segment, so the ranks waiting for this one to join raise why at once.
    seg_->unlink();
    std::string m = e.what();
    const std::string me = "rank " + std::to_string(rank_) + ": ";
    tp_.fail(e.kind(), m.compare(0, me.size(), me) == 0 ? m : me + m);
  } catch (...) {
    seg_->unlink();
    throw;
  }
  for (auto* v : {&send_chunk_, &send_msg_, &recv_chunk_, &recv_msg_}) v->assign(size_t(size_), 0);
  stash_.resize(size_t(size_));
  rx_busy_.assign(size_t(size_), 0);
  static std::atomic<int> made{0};
  label_ = "comm" + std::to_string(made.fetch_add(1));
  const char* fl = getenv("PLAIT_FLIGHT");
  if (!(fl && std::string(fl) == "0"))
    flight_.attach(seg_->flight_head(rank_), seg_->flight_ring(rank_), seg_->flight_slots());
  trace_ = Trace::from_env(rank_, size_);
  if (trace_) trace_->set_label(label_);
  tp_.set_flight(flight_.on() ? &flight_ : nullptr, trace_ != nullptr);
  tp_.set_idle_hook([this] { progress_parked(); });
  thread_ = std::thread([this] { progress_loop(); });
  {
    std::unique_lock<std::mutex> lk(ready_mu_);
    ready_cv_.wait(lk, [&] { return ready_ != 0; });
  }
  try {
    const double deadline = now_s() + opt_.init_timeout_s;
    wait_for_all_ranks(opt_.init_timeout_s);
    const char* sc = getenv("PLAIT_SINGLE_COPY");
    tp_.probe_peers(!(sc && std::string(sc) == "0"));
    tp_.agree_on_reads(deadline);
  } catch (...) {
    seg_->unlink();
    finalize();
    throw;
  }
  seg_->unlink();
}

Communicator::~Communicator() { finalize(); }

void Communicator::wait_for_all_ranks(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  for (int p = 0; p < size_; ++p) {
    RankCtl* c = seg_->ctl(p);
    Backoff b(policy_);
    double next_look = 0;  // reading /proc is not cheap: a few times per millisecond at most
    while (c->state.load(std::memory_order_acquire) == kStarting) {
      b.idle([&](double t) {
        tp_.throw_if_aborted();
        std::string why;
        if (t >= next_look && starting_rank_died(p, &why))
          tp_.fail(ErrorKind::peer_lost, "rank " + std::to_string(rank_) + ": " + why);
        if (t >= next_look) next_look = t + 2e-3;
        if (t > deadline) {
          std::ostringstream m;
          m << "rank " << rank_ << ": rank " << p << " did not join the " << size_
            << "-rank communicator within " << timeout_s << " s";
          tp_.fail(ErrorKind::timeout, m.str());
        }
      });
    }
  }
}

// A rank still starting is known only by the pid the rendezvous announced: gone from /proc, or a
// zombie there, means it died before joining (its progress thread would have gone live first).
bool Communicator::starting_rank_died(int p, std::string* why) const {
  const int32_t pid = size_t(p) < opt_.peer_pids.size() ? opt_.peer_pids[size_t(p)] : 0;
  if (pid <= 0 || seg_->ctl(p)->state.load(std::memory_order_acquire) != kStarting) return false;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  bool dead = false;
  if (FILE* f = std::fopen(path, "r")) {
    const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
    std::fclose(f);
    buf[n] = 0;
    const char* close = std::strrchr(buf, ')');  // the state follows the command's name
    dead = close && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
  } else {
    dead = kill(pid, 0) != 0 && errno == ESRCH;
  }
  if (dead)
    *why = "rank " + std::to_string(p) + " (pid " + std::to_string(pid) +
           ") died before it joined the " + std::to_string(size_) + "-rank communicator";
  return dead;
}

void Communicator::progress_loop() {
  RankCtl* me = seg_->ctl(rank_);
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  bool ok = pthread_mutex_init(&me->alive, &attr) == 0 && pthread_mutex_lock(&me->alive) == 0;
  pthread_mutexattr_destroy(&attr);
  me->pid = int32_t(getpid());
  if (ok) me->state.store(kAlive, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(ready_mu_);
    ready_ = ok ? 1 : -1;
  }
  ready_cv_.notify_all();
  if (!ok) return;
  std::vector<P2P> batch;
  bool busy = false;
  for (;;) {
    std::shared_ptr<Task> t;
    if (!parked_.empty()) {
      // Send/recv set aside for a collective or closure: run that, else resume them (with any
      // send/recv queued since). Nothing else runs a call meanwhile: parked tasks count in
      // pending_, so no caller runs its call itself.
      if (other_task_next()) {  // only this thread takes from the queue now
        std::lock_guard<std::mutex> lk(q_mu_);
        t = queue_.front();
        queue_.pop_front();
      } else {
        std::lock_guard<std::mutex> ex(exec_mu_);
        batch = std::move(parked_);
        parked_.clear();
        run_p2p(batch);  // finishes them, or parks them again
        continue;
      }
    } else {
      t = next_task(busy);
      if (!t) break;
    }
    busy = true;
    if (t->body) {
      ErrorKind kind = ErrorKind::none;
      std::string msg;
      {
        std::lock_guard<std::mutex> ex(exec_mu_);
        run_body(*t, &kind, &msg);
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
      t->finish(kind, msg);
      continue;
    }
    if (t->batched()) {
      batch.assign(1, op_of(t));
      std::lock_guard<std::mutex> ex(exec_mu_);
      run_p2p(batch);  // finishes (and absorbs further queued send/recv into) the batch
      continue;
    }
    ErrorKind kind = ErrorKind::none;
    std::string msg;
    std::shared_ptr<const std::string> flight;
    {
      std::lock_guard<std::mutex> ex(exec_mu_);
      try {
        run(t->args);
      } catch (const PlaitError& e) {
        kind = e.kind();
        msg = e.what();
        flight = annotate(kind, &msg);
      }
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
    t->finish(kind, msg, flight);
  }
  me->state.store(kExited, std::memory_order_release);
  pthread_mutex_unlock(&me->alive);
}

// No spinning before sleeping in here: the caller's thread often shares this rank's core
// (plait-bench pins ranks), and a spinning progress thread measured 5x slower async hand-offs
// than a wake-up.
std::shared_ptr<Task> Communicator::next_task(bool busy) {
  std::unique_lock<std::mutex> lk(q_mu_);
  for (;;) {
    if (!queue_.empty()) {
      const std::shared_ptr<Task>& t = queue_.front();
      // A deferred task is left to its caller for half the grace period, unless the thread is
      // awake anyway (busy: it ran a task), or someone waits or queued a call behind it.
      const bool taken = busy || wake_->urgent() || !t->deferred_ns_;
      if (taken || mono_ns() - t->deferred_ns_ >= wake_->grace_ns() / 2) {
        // Its caller did not come for it: it overlaps calls with other work (FSDP's prefetch),
        // so the next async calls start at once, without the grace's delay.
        if (!taken) eager_calls_ = kEagerCalls;
        std::shared_ptr<Task> r = t;
        queue_.pop_front();
        return r;
      }
      wake_->tick_on();
    } else if (stop_) {
      return nullptr;
    } else {
      wake_->clear_urgent();
    }
    busy = false;
    sleeping_ = true;
    lk.unlock();
    const bool ticked = wake_->sleep();
    lk.lock();
    sleeping_ = false;
    if (ticked && queue_.empty()) wake_->idle_tick();
  }
}

void Communicator::enqueue(const std::shared_ptr<Task>& t, bool deferred) {
  pending_.fetch_add(1, std::memory_order_acq_rel);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    if (deferred && eager_calls_ > 0) {
      --eager_calls_;
      deferred = false;
    }
    queue_.push_back(t);
    if (deferred) {
      t->deferred_ns_ = mono_ns();
      t->wake_ = wake_;
      if (sleeping_) wake_->tick_on();
    } else {
      wake_->kick(/*asleep=*/false);  // hurries deferred tasks ahead of t
      wake = sleeping_;
    }
  }
  if (wake) wake_->kick();  // with q_mu_ released, which the woken thread takes first
}

namespace {
// A number in [0, max] from the environment, or dflt when it is unset or empty; anything else
// is refused naming the variable.
double env_number(const char* name, double dflt, double max, const char* what) {
  const char* e = getenv(name);
  if (!e || !*e) return dflt;
  char* end = nullptr;
  const double v = std::strtod(e, &end);
  if (*end || !(v >= 0) || v > max) {
    std::ostringstream m;
    m << name << " must be " << what << " in [0, " << max << "], got '" << e << "'";
    throw InvalidArgument(m.str());
  }
  return v;
}
}  // namespace

void check_env() {
  const char* algo = getenv("PLAIT_ALGO");
  AlgoOverride(algo ? algo : "", kShmCaps, /*strict=*/true, "PLAIT_ALGO");
  env_number("PLAIT_ASYNC_GRACE_US", 0, 1e7, "microseconds (0: async calls start at once)");
  env_number("PLAIT_ASYNC_DEFER_BYTES", 0, 1e15,
             "bytes (0: only empty calls wait for their caller)");
}

void Communicator::read_async_policy() {
  // How long a small async collective is left to its caller, and how small (core/wakeup.h).
  const double us = env_number("PLAIT_ASYNC_GRACE_US", double(kAsyncGraceNs) / 1000, 1e7,
                               "microseconds (0: async calls start at once)");
  defer_max_bytes_ = size_t(env_number("PLAIT_ASYNC_DEFER_BYTES", double(kDeferMaxBytes), 1e15,
                                       "bytes (0: only empty calls wait for their caller)"));
  wake_ = std::make_shared<Wakeup>(uint64_t(us * 1000));
}

std::string Communicator::dead_peer() {
  for (int p = 0; p < size_; ++p) {
    std::string why;
    bool died = false;
    if (p != rank_ && tp_.peer_gone(p, &why, &died) && died) return why;
  }
  return "";
}

void Communicator::finalize() {
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    stop_ = true;
  }
  wake_->kick();
  if (thread_.joinable()) thread_.join();
  if (trace_) trace_->flush();
}

void Communicator::fail(ErrorKind kind, const std::string& msg) {
  try {
    tp_.fail(kind, msg);
  } catch (const PlaitError& e) {
    rethrow(e);
  }
}

void Communicator::rethrow(const PlaitError& e) {
  // The first error a rank sees is raised as what it is; after that the communicator is dead.
  if (!reported_abort_) {
    reported_abort_ = true;
    std::string msg = e.what();
    first_error_ = msg.substr(0, msg.find(kFlightMarker));
    // An error from the progress thread comes with its report already.
    auto flight = e.flight ? e.flight : annotate(e.kind(), &msg);
    throw_error(e.kind(), msg, flight);
  }
  throw PlaitError("communicator aborted after an earlier error: " + first_error_);
}

int Communicator::resolve_algo(Coll c, const std::string& name, size_t bytes) {
  std::string why;
  const int i =
      select_algorithm(c, name, override_, kShmCaps,
                       {tp_.caps(), bytes, size_, tp_.staging_bytes(), opt_.oversubscribed}, rank_,
                       tp_.read_unavailable(), &why);
  if (i < 0) fail(ErrorKind::invalid, why);
  return i;
}

CallArgs Communicator::validate(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root,
                                int peer, int64_t tag, const std::string& algo,
                                std::optional<double> timeout_s) {
  CallArgs a;
  const std::string why = validate_call(c, in, out, op, root, peer, tag,
                                        timeout_s.value_or(opt_.timeout_s), rank_, size_,
                                        /*any_source=*/true, &a);
  if (!why.empty()) fail(ErrorKind::invalid, why);
  if (c != Coll::send && c != Coll::recv)
    a.algo = resolve_algo(c, algo, size_t(a.count) * dtype_size(a.dtype));
  return a;
}

void Communicator::attach_device(std::shared_ptr<DeviceQueue> q) {
  std::lock_guard<std::mutex> lk(dev_mu_);
  if (dev_)
    throw InvalidArgument("rank " + std::to_string(rank_) +
                          ": this communicator already has a GPU transport (" + dev_->transport() +
                          " on GPU " + std::to_string(dev_->device()) + ")");
  if (q->rank() != rank_ || q->size() != size_)
    throw InvalidArgument("a GPU queue of rank " + std::to_string(q->rank()) + " of " +
                          std::to_string(q->size()) + " cannot serve rank " +
                          std::to_string(rank_) + " of " + std::to_string(size_));
  dev_ = std::move(q);
}

std::shared_ptr<DeviceQueue> Communicator::device_queue() {
  std::lock_guard<std::mutex> lk(dev_mu_);
  return dev_;
}

void Communicator::call_device(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root,
                               int peer, int64_t tag, const std::string& algo,
                               std::optional<double> timeout_s) {
  std::shared_ptr<DeviceQueue> q = device_queue();
  auto head = [&] { return "rank " + std::to_string(rank_) + ": " + coll_name(c); };
  if (!q)
    fail(ErrorKind::invalid, head() +
                                 ": GPU arrays need this communicator's GPU transport, which "
                                 "the first GPU call creates on every rank (plait._gpu)");
  if (tag != 0)
    fail(ErrorKind::invalid,
         head() + ": tag " + std::to_string(tag) +
             ": GPU send/recv have no tags; they match in issue order per pair of ranks (tag=0)");
  const bool ipc = std::strcmp(q->transport(), "ipc") == 0;
  // The queue's own errors reach every rank through it (GpuPeers); the check's go through
  // fail(), like a host call's.
  const int device = (in.present ? in : out).device_index;
  q->call(c, in, out, op, root, peer, algo, timeout_s.value_or(-1.0),
          [&](const CallArgs& a, const char* name) { check_gpu_call(a, name, ipc, device); });
}

std::shared_ptr<Task> Communicator::call(Coll c, const Buffer& in, const Buffer& out, RedOp op,
                                         int root, int peer, int64_t tag, const std::string& algo,
                                         std::optional<double> timeout_s, bool async,
                                         Task::Done on_done) {
  if (closed_)
    throw PlaitError("communicator is finalized; " + std::string(coll_name(c)) +
                     " needs a live one");
  if (reported_abort_)
    throw PlaitError("communicator aborted after an earlier error: " + first_error_);
  if ((in.present ? in : out).device == Device::cuda) {
    call_device(c, in, out, op, root, peer, tag, algo, timeout_s);
    return nullptr;
  }
  CallArgs a = validate(c, in, out, op, root, peer, tag, algo, timeout_s);
  if (tl_inside_ == this) {  // a step of a closure task: exec_mu_ is held, the call runs now
    run_now(a);
    return nullptr;
  }
  if (!async) {
    // Runs here when nothing is queued or running. Another thread in a call (the progress
    // thread in a batch of send/recv, which may be waiting for this very call: irecv, then a
    // blocking send) means: queue it behind, never wait for that thread's lock.
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    if (ex.owns_lock() && pending_.load(std::memory_order_acquire) == 0) {
      run_now(a);
      return nullptr;
    }
  }
  auto t = std::make_shared<Task>(a);
  t->on_done_ = std::move(on_done);
  // A small async collective is left to its caller to run when it waits (core/wakeup.h); a send
  // or recv is not (run_here does not take them: they progress in batches).
  const bool small = size_t(a.count) * dtype_size(a.dtype) <= defer_max_bytes_;
  enqueue(t, async && small && c != Coll::send && c != Coll::recv && wake_->grace_ns() > 0);
  if (async) return t;
  try {
    notify_long_wait();
    t->wait(std::nullopt);
  } catch (const PlaitError& e) {
    rethrow(e);
  }
  return nullptr;
}

void Communicator::run_now(CallArgs& a) {
  try {
    if (a.coll == Coll::send || a.coll == Coll::recv) {
      std::vector<P2P> one{P2P{&a, nullptr}};
      run_p2p(one);
    } else {
      run(a);
    }
  } catch (const PlaitError& e) {
    rethrow(e);
  }
}

thread_local const Communicator* Communicator::tl_inside_ = nullptr;
thread_local Task* Communicator::tl_task_ = nullptr;

void Communicator::run_body(Task& t, ErrorKind* kind, std::string* msg) {
  InsideBody inside(this, &t);
  try {
    t.body();
  } catch (const PlaitError& e) {
    *kind = e.kind();
    *msg = e.what();
  } catch (const std::exception& e) {
    *kind = ErrorKind::generic;
    *msg = "rank " + std::to_string(rank_) + ": " + e.what();
  }
}

std::shared_ptr<Task> Communicator::submit(const CallArgs& a, std::function<void()> body,
                                           bool async, bool deferred, Task::Done on_done) {
  if (closed_)
    throw PlaitError("communicator is finalized; " + std::string(coll_name(a.coll)) +
                     " needs a live one");
  if (!async) {  // here only when nothing is queued or running (see call())
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    if (ex.owns_lock() && pending_.load(std::memory_order_acquire) == 0) {
      InsideBody inside(this, nullptr);
      body();
      return nullptr;
    }
  }
  auto t = std::make_shared<Task>(a);
  t->body = std::move(body);
  t->on_done_ = std::move(on_done);
  enqueue(t, async && deferred && wake_->grace_ns() > 0);
  if (async) return t;
  notify_long_wait();
  t->wait(std::nullopt);
  return nullptr;
}

std::shared_ptr<Task> Communicator::submit_step(const CallArgs& a,
                                                std::function<int(CallArgs&)> step, bool async,
                                                Task::Done on_done, Task::Reword reword) {
  if (closed_)
    throw PlaitError("communicator is finalized; " + std::string(coll_name(a.coll)) +
                     " needs a live one");
  if (a.coll != Coll::send && a.coll != Coll::recv)
    throw InvalidArgument("submit_step takes a send or a recv");
  if (!async) {  // here only when nothing is queued or running (see call())
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    if (ex.owns_lock() && pending_.load(std::memory_order_acquire) == 0) {
      CallArgs mine = a;
      std::vector<P2P> one{P2P{&mine, nullptr}};
      one[0].ext = &step;
      run_p2p(one);  // its PlaitError is thrown as it is: the layer above reports it
      return nullptr;
    }
  }
  auto t = std::make_shared<Task>(a);
  t->step = std::move(step);
  t->on_done_ = std::move(on_done);
  t->reword = std::move(reword);
  enqueue(t, false);
  if (async) return t;
  notify_long_wait();
  t->wait(std::nullopt);
  return nullptr;
}

bool Communicator::run_here(const std::shared_ptr<Task>& t) {
  if (t->done()) return true;
  // batched, except a closure task's (its body runs in its own turn)
  if (t->batched()) return false;
  ErrorKind kind = ErrorKind::none;
  std::string msg;
  {
    // exec_mu_ first: once t leaves the queue, nothing issued later may run before it.
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    auto take_if_next = [&] {
      std::lock_guard<std::mutex> lk(q_mu_);
      // Nothing running (pending_ counts queued and running calls) and t next in line.
      if (queue_.empty() || queue_.front() != t ||
          size_t(pending_.load(std::memory_order_acquire)) != queue_.size())
        return false;
      queue_.pop_front();
      return true;
    };
    if (!ex.owns_lock() || !take_if_next()) {
      if (ex.owns_lock()) ex.unlock();
      wake_->kick();  // the caller waits next: deferred tasks ahead of t must start now
      return false;
    }
    if (t->body) {
      run_body(*t, &kind, &msg);
    } else {
      try {
        run(t->args);
      } catch (const PlaitError& e) {
        kind = e.kind();
        msg = e.what();
      }
    }
  }
  pending_.fetch_sub(1, std::memory_order_acq_rel);
  t->finish(kind, msg);  // outside exec_mu_: its callback may issue calls
  return true;
}

// One rank: every collective is a copy of the input (or nothing, in place). avg divides by 1.
void Communicator::run_local(const CallArgs& a) {
  if (a.coll == Coll::barrier || !a.out || a.out == a.in) return;
  std::memmove(a.out, a.in, size_t(a.count) * dtype_size(a.dtype));
}

void Communicator::run(CallArgs& a) {
  tp_.throw_if_aborted();
  const Algorithm* algo = algorithms_for(a.coll, kShmCaps)[size_t(a.algo)];
  const uint64_t seq = ++seq_;
  // One clock reading serves the call's deadline and its flight record.
  const uint64_t t0 = mono_ns();
  const uint64_t rec = flight_.begin(a, seq, uint8_t(a.algo), t0);
  try {
    if (size_ == 1) {
      run_local(a);
    } else {
      tp_.begin(a, algo->name, seq, uint8_t(a.algo), double(t0) * 1e-9);
      Ctx ctx(tp_, a);
      algo->run.on_host(ctx);
      tp_.end();
    }
  } catch (const PlaitError&) {
    recorded(a, rec, seq, algo->name, t0, tp_.take_waited_ns(), false);
    throw;
  } catch (const std::exception& e) {
    recorded(a, rec, seq, algo->name, t0, tp_.take_waited_ns(), false);
    tp_.fail(ErrorKind::generic,
             "rank " + std::to_string(rank_) + ": " + tp_.describe_call() + " failed: " + e.what());
  }
  recorded(a, rec, seq, algo->name, t0, tp_.take_waited_ns(), true);
}

void Communicator::recorded(const CallArgs& a, uint64_t rec, uint64_t call, const char* algo,
                            uint64_t t0, uint64_t wait_ns, bool ok) {
  if (!flight_.on() && !trace_) return;
  // A finished call's end time need not be exact unless a trace shows it; a failed one's is.
  const bool exact = trace_ || !ok;
  const uint64_t t1 = exact ? mono_ns() : std::max(coarse_ns(), t0);
  flight_.end(rec, ok, t1, exact);
  if (trace_) {
    const bool p2p = a.coll == Coll::send || a.coll == Coll::recv;
    const bool rooted = a.coll == Coll::broadcast || a.coll == Coll::reduce;
    trace_->add(TraceEvent{t0, t1, wait_ns, call, a.count, a.tag,
                           p2p      ? a.peer
                           : rooted ? a.root
                                    : -1,
                           uint8_t(a.coll), uint8_t(a.dtype), uint8_t(a.op), ok, algo});
  }
}

// ---------------------------------------------------------------------------------------------
// Flight recorder reports

void Communicator::set_label(const std::string& label) {
  {
    std::lock_guard<std::mutex> lk(label_mu_);
    label_ = label;
  }
  if (trace_) trace_->set_label(label);
}

std::string Communicator::label() const {
  std::lock_guard<std::mutex> lk(label_mu_);
  return label_;
}

namespace {
// The kernel's word for a live process: a rank that is alive but frozen (SIGSTOP, a debugger)
// looks just like a slow one from the segment.
std::string process_state(int32_t pid) {
  char path[64], buf[256];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  FILE* f = pid > 0 ? std::fopen(path, "r") : nullptr;
  if (!f) return "alive";
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": comm may hold anything
  const char s = close && close[1] == ' ' ? close[2] : '?';
  return s == 'T' || s == 't' ? "stopped" : s == 'Z' || s == 'X' ? "dead" : "alive";
}
}  // namespace

std::vector<std::string> Communicator::peer_states() {
  std::vector<std::string> st(static_cast<size_t>(size_));
  for (int p = 0; p < size_; ++p) {
    std::string why;
    const uint32_t s = seg_->ctl(p)->state.load(std::memory_order_acquire);
    if (p == rank_)
      st[size_t(p)] = "this rank";
    else if (tp_.peer_gone(p, &why))
      st[size_t(p)] = s == kExited ? "exited" : "dead";
    else
      st[size_t(p)] = s == kStarting ? "starting" : process_state(seg_->ctl(p)->pid);
  }
  return st;
}

std::string Communicator::flight_json() {
  return flight_report(*seg_, rank_, label(), "", peer_states()).json;
}

void Communicator::flight_scribble(int r, uint64_t seed) {
  if (r < 0 || r >= size_) throw InvalidArgument("flight_scribble: no rank " + std::to_string(r));
  plait::flight_scribble(*seg_, r, seed);
}

std::shared_ptr<const std::string> Communicator::annotate(ErrorKind kind, std::string* msg) {
  if (!seg_->flight_slots() ||
      (kind != ErrorKind::timeout && kind != ErrorKind::peer_lost && kind != ErrorKind::mismatch))
    return nullptr;
  FlightReport rep = flight_report(*seg_, rank_, label(), *msg, peer_states());
  auto json = std::make_shared<const std::string>(rep.json);
  // Under plait-run --dump-on-error the launcher prints one summary for all ranks: each rank
  // writes its report there and its message says where, instead of repeating the summary.
  const char* dir = getenv("PLAIT_DUMP_ON_ERROR");
  if (dir && *dir) {
    const char* r = getenv("RANK");
    const std::string path =
        std::string(dir) + "/flight-rank" + (r && *r ? r : std::to_string(rank_)) + ".json";
    // O_EXCL: the first error of this process wins (a later one is "aborted after an earlier").
    int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd >= 0) {
      const bool whole = write(fd, rep.json.data(), rep.json.size()) == ssize_t(rep.json.size());
      close(fd);
      if (whole) {
        *msg += std::string(kFlightMarker) + ": report written to " + path;
        return json;
      }
    }
  }
  *msg += "\n" + rep.summary;
  return json;
}

}  // namespace plait
