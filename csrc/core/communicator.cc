#include "core/communicator.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace plait {

bool Task::wait(double timeout_s) {
  if (!done()) {
    std::unique_lock<std::mutex> lk(m_);
    auto pred = [&] { return done(); };
    if (timeout_s < 0) {
      cv_.wait(lk, pred);
    } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), pred)) {
      return false;
    }
  }
  if (state_.load(std::memory_order_acquire) == 2) throw_error(kind_, msg_);
  return true;
}

void Task::finish(ErrorKind kind, std::string msg) {
  {
    std::lock_guard<std::mutex> lk(m_);
    kind_ = kind;
    msg_ = std::move(msg);
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
      tp_(*seg_, rank, policy_) {
  if (opt_.oversubscribed) policy_.spin_iters = 16;
  forced_.assign(size_t(Coll::kCount), "");
  try {
    parse_algo_override();
  } catch (...) {
    seg_->unlink();
    throw;
  }
  for (auto* v : {&send_chunk_, &send_msg_, &recv_chunk_, &recv_msg_}) v->assign(size_t(size_), 0);
  stash_.resize(size_t(size_));
  rx_busy_.assign(size_t(size_), 0);
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

void Communicator::parse_algo_override() {
  std::stringstream ss(opt_.algo_override);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    bool used = false;
    for (int c = 0; c < int(Coll::kCount); ++c) {
      std::string name = eq == std::string::npos ? item : item.substr(eq + 1);
      if (eq != std::string::npos && item.substr(0, eq) != coll_name(Coll(c))) continue;
      for (auto* a : algorithms_for(Coll(c)))
        if (name == a->name) forced_[size_t(c)] = name, used = true;
    }
    if (!used)
      throw InvalidArgument("PLAIT_ALGO: '" + item + "' names no algorithm (see plait.algorithms(collective))");
  }
}

Communicator::~Communicator() { finalize(); }

void Communicator::wait_for_all_ranks(double timeout_s) {
  const double deadline = now_s() + timeout_s;
  for (int p = 0; p < size_; ++p) {
    RankCtl* c = seg_->ctl(p);
    Backoff b(policy_);
    while (c->state.load(std::memory_order_acquire) == kStarting) {
      b.idle([&](double t) {
        tp_.throw_if_aborted();
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
  for (;;) {
    std::shared_ptr<Task> t;
    // No spinning before sleeping here: the caller's thread usually shares this rank's core
    // (plait-bench and torch pin ranks), and a spinning progress thread measured 5x slower
    // async hand-offs than the ~30 us condition-variable wake-up.
    {
      std::unique_lock<std::mutex> lk(q_mu_);
      q_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) break;
      t = queue_.front();
      queue_.pop_front();
    }
    if (t->args.coll == Coll::send || t->args.coll == Coll::recv) {
      batch.clear();
      batch.push_back(P2P{&t->args, t});
      std::lock_guard<std::mutex> ex(exec_mu_);
      run_p2p(batch);  // finishes (and absorbs further queued send/recv into) the batch
      continue;
    }
    ErrorKind kind = ErrorKind::none;
    std::string msg;
    {
      std::lock_guard<std::mutex> ex(exec_mu_);
      try {
        run(t->args);
      } catch (const PlaitError& e) {
        kind = e.kind();
        msg = e.what();
      }
    }
    pending_.fetch_sub(1, std::memory_order_acq_rel);
    t->finish(kind, msg);
  }
  me->state.store(kExited, std::memory_order_release);
  pthread_mutex_unlock(&me->alive);
}

void Communicator::enqueue(const std::shared_ptr<Task>& t) {
  pending_.fetch_add(1, std::memory_order_acq_rel);
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    queue_.push_back(t);
  }
  q_cv_.notify_one();
}

void Communicator::finalize() {
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
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
    first_error_ = e.what();
    throw_error(e.kind(), e.what());
  }
  throw PlaitError("communicator aborted after an earlier error: " + first_error_);
}

int Communicator::resolve_algo(Coll c, const std::string& name, size_t bytes) {
  const auto& algos = algorithms_for(c);
  const std::string& want = name == "auto" || name.empty() ? forced_[size_t(c)] : name;
  if (want.empty()) return auto_select(c, bytes, size_, tp_.staging_bytes(), tp_.can_read_peers(),
                                           opt_.oversubscribed);
  for (size_t i = 0; i < algos.size(); ++i) {
    if (want != algos[i]->name) continue;
    if (algos[i]->single_copy && !tp_.can_read_peers() && size_ > 1)
      fail(ErrorKind::invalid, "rank " + std::to_string(rank_) + ": " + coll_name(c) + " algorithm '" +
                                   want + "' is not available on this communicator: " +
                                   tp_.read_unavailable());
    return int(i);
  }
  std::string names;
  for (auto* a : algos) names += std::string(names.empty() ? "" : ", ") + a->name;
  fail(ErrorKind::invalid, "rank " + std::to_string(rank_) + ": " + coll_name(c) +
                               " has no algorithm '" + want + "' (choose auto, " + names + ")");
}

CallArgs Communicator::validate(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root,
                                int peer, int64_t tag, const std::string& algo, double timeout_s) {
  CallArgs a;
  a.coll = c;
  a.op = op;
  a.root = root;
  a.peer = peer;
  a.tag = tag;
  a.timeout_s = timeout_s > 0 ? timeout_s : opt_.timeout_s;
  const Buffer& first = in.present ? in : out;
  a.dtype = first.dtype;
  const size_t es = dtype_size(a.dtype);
  // Built only when something is wrong: a stream per call would cost more than the call.
  std::unique_ptr<std::ostringstream> why;
  auto bad = [&]() -> std::ostream& {
    if (!why) {
      why.reset(new std::ostringstream);
      *why << "rank " << rank_ << ": " << coll_name(c) << ": ";
    } else {
      *why << "; ";
    }
    return *why;
  };
  auto check_buf = [&](const Buffer& b, const char* name, bool write) {
    if (!b.present) return;
    if (b.device != Device::cpu)
      bad() << name << " is a GPU buffer but this communicator is on shared memory (CPU)";
    if (!b.contiguous) bad() << name << " is not contiguous (pass a C-contiguous array)";
    if (write && !b.writable) bad() << name << " is read-only";
    if (b.dtype != a.dtype)
      bad() << name << " has dtype " << dtype_name(b.dtype) << " but input has " << dtype_name(a.dtype);
    if (b.bytes % es) bad() << name << " has " << b.bytes << " bytes, not a whole number of elements";
  };
  auto overlap = [](const Buffer& x, const Buffer& y) {
    auto xs = static_cast<const char*>(x.ptr), ys = static_cast<const char*>(y.ptr);
    return x.bytes && y.bytes && xs < ys + y.bytes && ys < xs + x.bytes;
  };
  const bool is_root = root == rank_;
  const bool needs_out = c != Coll::barrier && c != Coll::send && !(c == Coll::reduce && !is_root);
  check_buf(in, "input", false);
  check_buf(out, "output", true);
  if (needs_out && !out.present) bad() << "an output buffer is required";
  if (c == Coll::send && !in.present) bad() << "send needs an input buffer";
  if ((c == Coll::broadcast || c == Coll::reduce) && (root < 0 || root >= size_))
    bad() << "root " << root << " is out of range for " << size_ << " ranks";
  if ((c == Coll::send || c == Coll::recv) && (peer < 0 || peer >= size_ || peer == rank_) &&
      !(c == Coll::recv && peer == kAnySource))
    bad() << "peer " << peer << " is not another rank of this " << size_ << "-rank communicator";
  if (op == RedOp::avg && !is_float(a.dtype))
    bad() << "op avg needs a floating-point dtype, got " << dtype_name(a.dtype);
  if (unsigned(op) >= unsigned(RedOp::kCount)) bad() << "unknown reduction op";
  const size_t inb = in.present ? in.bytes : 0, outb = out.present ? out.bytes : 0;
  const size_t n = size_t(size_);
  auto same_or_apart = [&](const Buffer& x, const Buffer& y, const void* allowed, const char* what) {
    if (x.present && y.present && overlap(x, y) && x.ptr != allowed)
      bad() << "input and output overlap (" << what << ")";
  };
  switch (c) {
    case Coll::allreduce:
    case Coll::broadcast:
      if (out.present && outb != inb) bad() << "output has " << outb << " bytes, input " << inb;
      same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr, "only out is x is allowed");
      a.count = int64_t(inb / es);
      break;
    case Coll::reduce:
      if (is_root && out.present && outb != inb) bad() << "output has " << outb << " bytes, input " << inb;
      if (is_root) same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr, "only out is x is allowed");
      a.count = int64_t(inb / es);
      break;
    case Coll::reduce_scatter:
      if (inb != n * outb)
        bad() << "input has " << inb << " bytes but must be " << size_ << " x the output's " << outb;
      same_or_apart(out, in, static_cast<const char*>(in.ptr) + size_t(rank_) * outb,
                    "in place means output is this rank's block of the input");
      a.count = int64_t(outb / es);
      break;
    case Coll::allgather:
      if (outb != n * inb)
        bad() << "output has " << outb << " bytes but must be " << size_ << " x the input's " << inb;
      same_or_apart(in, out, static_cast<const char*>(out.ptr) + size_t(rank_) * inb,
                    "in place means input is this rank's block of the output");
      a.count = int64_t(inb / es);
      break;
    case Coll::alltoall:
      if (inb % (n * es)) bad() << "input has " << inb << " bytes, not " << size_ << " equal blocks";
      if (outb != inb) bad() << "output has " << outb << " bytes, input " << inb;
      same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr, "only out is x is allowed");
      a.count = int64_t(inb / (n * es));
      break;
    case Coll::send:
      a.count = int64_t(inb / es);
      break;
    case Coll::recv:
      a.count = int64_t(outb / es);
      break;
    case Coll::barrier:
    case Coll::kCount:
      break;
  }
  a.in = in.present ? in.ptr : nullptr;
  a.out = out.present ? out.ptr : nullptr;
  if (why) fail(ErrorKind::invalid, why->str());
  if (c != Coll::send && c != Coll::recv) a.algo = resolve_algo(c, algo, size_t(a.count) * es);
  return a;
}

std::shared_ptr<Task> Communicator::call(Coll c, const Buffer& in, const Buffer& out, RedOp op,
                                         int root, int peer, int64_t tag, const std::string& algo,
                                         double timeout_s, bool async, Task::Done on_done) {
  if (closed_) throw PlaitError("communicator is finalized; " + std::string(coll_name(c)) + " needs a live one");
  if (reported_abort_) throw PlaitError("communicator aborted after an earlier error: " + first_error_);
  CallArgs a = validate(c, in, out, op, root, peer, tag, algo, timeout_s);
  if (!async) {
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    if (!ex.owns_lock()) {  // another thread is in a call: this may take long
      notify_long_wait();
      ex.lock();
    }
    if (pending_.load(std::memory_order_acquire) == 0) {
      try {
        if (c == Coll::send || c == Coll::recv) {
          std::vector<P2P> one{P2P{&a, nullptr}};
          run_p2p(one);
        } else {
          run(a);
        }
      } catch (const PlaitError& e) {
        rethrow(e);
      }
      return nullptr;
    }
  }
  auto t = std::make_shared<Task>(a);
  t->on_done_ = std::move(on_done);
  enqueue(t);
  if (async) return t;
  try {
    notify_long_wait();
    t->wait(-1);
  } catch (const PlaitError& e) {
    rethrow(e);
  }
  return nullptr;
}

bool Communicator::run_here(const std::shared_ptr<Task>& t) {
  if (t->done()) return true;
  if (t->args.coll == Coll::send || t->args.coll == Coll::recv) return false;  // batched
  ErrorKind kind = ErrorKind::none;
  std::string msg;
  {
    // exec_mu_ first: once t leaves the queue, nothing issued later may run before it.
    std::unique_lock<std::mutex> ex(exec_mu_, std::try_to_lock);
    if (!ex.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lk(q_mu_);
      // Nothing running (pending_ counts queued and running calls) and t next in line.
      if (queue_.empty() || queue_.front() != t ||
          size_t(pending_.load(std::memory_order_acquire)) != queue_.size())
        return false;
      queue_.pop_front();
    }
    try {
      run(t->args);
    } catch (const PlaitError& e) {
      kind = e.kind();
      msg = e.what();
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
  const Algorithm* algo = algorithms_for(a.coll)[size_t(a.algo)];
  if (size_ == 1) {
    run_local(a);
    return;
  }
  try {
    tp_.begin(a, algo->name, ++seq_, uint8_t(a.algo));
    Ctx ctx(tp_, a);
    algo->run(ctx);
    tp_.end();
  } catch (const PlaitError&) {
    throw;
  } catch (const std::exception& e) {
    tp_.fail(ErrorKind::generic, "rank " + std::to_string(rank_) + ": " + tp_.describe_call() +
                                     " failed: " + e.what());
  }
}

}  // namespace plait
