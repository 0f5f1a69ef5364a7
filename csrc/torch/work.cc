// Op and Work: how a torch call's plait calls end in a completed Work and Future.
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "torch/backend.h"

namespace plait_torch {

thread_local bool tl_running_here = false;  // this thread runs a task through task_run

Error::Error(uint32_t kind, const std::string& msg, std::string group)
    : c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)}, msg),
      kind_(kind),
      group_(std::move(group)) {}

namespace {
c10::intrusive_ptr<c10::ivalue::Future> new_future() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return c10::make_intrusive<c10::ivalue::Future>(type);
}
}  // namespace

Op::Op(Backend* b, std::string what, std::vector<at::Tensor> value)
    : b_(b), what_(std::move(what)), value_(std::move(value)) {}

std::string Op::where() const { return b_->label(what_); }

void Op::start() {
  if (done()) return;
  for (void* t : tasks_) b_->api()->task_start(t);
}

c10::intrusive_ptr<c10::ivalue::Future> Op::future() {
  // Made on first request: most calls (dist.* without async_op) never hand one out. Whoever
  // takes it (DDP's reducer) goes on without waiting: the calls start now.
  if (gpu_) return gpu_future();
  start();
  std::lock_guard<std::mutex> lk(mu_);
  if (!fut_) {
    fut_ = new_future();
    const int s = state_.load(std::memory_order_acquire);
    if (s == 1) fut_->markCompleted(c10::IValue(value_));
    if (s == 2) fut_->setError(error_);
  }
  return fut_;
}

Op::~Op() {
  for (void* t : tasks_) b_->api()->task_release(t);
}

void Op::issue(uint8_t coll, const plait_buffer* in, const plait_buffer* out, uint8_t op, int root,
               int peer, int64_t tag) {
  const plait_buffer* any = in && in->present ? in : out;
  if (any && any->device == PLAIT_CUDA) return issue_gpu(coll, in, out, op, root, peer, tag);
  if (gpu_) b_->fail(what_ + ": CPU and CUDA tensors in one call; pass all of them on one device");
  char err[1024];
  const bool p2p = coll == PLAIT_SEND || coll == PLAIT_RECV;
  uint32_t kind;
  if (sync && !p2p) {
    kind = b_->api()->call(b_->comm(), coll, in, out, op, root, peer, tag, "auto", timeout_s,
                           nullptr, nullptr, nullptr, err, sizeof err);
  } else {
    auto* ctx = new std::shared_ptr<Op>(weak.lock());
    outstanding_.fetch_add(1, std::memory_order_acq_rel);
    void* task = nullptr;
    kind = b_->api()->call(b_->comm(), coll, in, out, op, root, peer, tag, "auto", timeout_s,
                           &Op::on_call_done, ctx, &task, err, sizeof err);
    if (kind) {
      outstanding_.fetch_sub(1, std::memory_order_acq_rel);
      delete ctx;
    } else if (task) {
      tasks_.push_back(task);
    }
  }
  if (kind) throw b_->error(kind, where(), err);
}

void Op::on_call_done(void* ctx, uint32_t kind, const char* msg) {
  auto* self = static_cast<std::shared_ptr<Op>*>(ctx);
  std::shared_ptr<Op> op = std::move(*self);
  delete self;
  op->finish_call(kind, msg);
}

void Op::finish_call(uint32_t kind, const char* msg) {
  if (kind) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!kind_) {
      kind_ = kind;
      msg_ = msg;
    }
  }
  if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  if (waiter_completes || sync) {
    std::lock_guard<std::mutex> lk(mu_);
    cv_.notify_all();  // launch() completes it
  } else if (tl_running_here) {
    complete();  // a waiter ran the call: complete on its thread, with no hand-off
  } else if (!complete_unless_future()) {
    b_->post(weak.lock());  // plait's progress thread: hand over, never run callbacks here
  }
}

// On plait's progress thread: an op nobody asked a Future of (dist.* with async_op=True, then
// wait()) completes here, sparing the waiter a second thread hop (the completion thread's
// wake-up, then the waiter's). Its steps are C++ tensor copies; only a Future's callbacks could
// run user code, so an op with a Future (or one asked for while the steps ran) is handed over.
bool Op::complete_unless_future() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fut_) return false;
  }
  run_steps();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (fut_) return false;  // the completion thread marks the Future (the steps have run)
    state_.store(kind_ ? 2 : 1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& f : followers_) f->release(kind_, msg_.c_str());
  followers_.clear();
  return true;
}

// The steps after the calls (copies back into the caller's tensors), once; a failed call or
// step becomes the op's error.
void Op::run_steps() {
  if (ran_steps_) return;
  ran_steps_ = true;
  if (!kind_) {
    try {
      for (auto& f : after_) f();
    } catch (const std::exception& e) {
      kind_ = 1;
      msg_ = e.what();
    }
  }
  after_.clear();
  keep_.clear();
  if (kind_) error_ = std::make_exception_ptr(b_->error(kind_, where(), msg_));
}

void Op::complete() {
  run_steps();
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  {
    std::lock_guard<std::mutex> lk(mu_);
    state_.store(kind_ ? 2 : 1, std::memory_order_release);
    fut = fut_;  // one made later completes at birth (future())
  }
  cv_.notify_all();
  for (auto& f : followers_) f->release(kind_, msg_.c_str());
  followers_.clear();
  if (fut && kind_) {
    fut->setError(error_);
  } else if (fut) {
    fut->markCompleted(c10::IValue(value_));
  }
}

bool Op::poll() {
  start();
  if (!done()) return false;
  return !gpu_ || state_.load(std::memory_order_acquire) == 2 || !gpu_->event ||
         gpu_->event->query();
}

c10::intrusive_ptr<c10d::Work> Op::launch() {
  if (gpu_) return launch_gpu();
  auto me = weak.lock();
  if (outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    complete();  // every call ran inline (or finished already)
  } else if (waiter_completes || sync) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return outstanding_.load(std::memory_order_acquire) == 0; });
    }
    complete();
  }
  if (sync && state_.load() == 2) std::rethrow_exception(error_);
  return c10::make_intrusive<Work>(me, c10d::OpType::UNKNOWN);
}

bool Op::wait(std::chrono::milliseconds timeout) {
  if (gpu_) {  // as c10d's NCCL Work: the current stream waits for the calls, the host does not
    if (state_.load() == 2) std::rethrow_exception(error_);
    if (timeout.count() > 0) wait_gpu(timeout);
    block_current_stream();
    return true;
  }
  if (!done() && timeout.count() > 0) {
    start();  // running them here could outlast the timeout
  } else if (!done()) {
    // Run the calls still queued here when plait's thread is idle: saves two thread hops, or
    // (for calls plait left to their waiter, core/wakeup.h) its wake-up.
    tl_running_here = true;
    for (void* t : tasks_)
      if (!b_->api()->task_run(b_->comm(), t)) break;
    tl_running_here = false;
  }
  if (!done()) {
    std::unique_lock<std::mutex> lk(mu_);
    auto pred = [&] { return done(); };
    if (timeout.count() <= 0) {
      cv_.wait(lk, pred);
    } else if (!cv_.wait_for(lk, timeout, pred)) {
      throw Error(kTimeout, where() + ": Work.wait Timed out after " +
                                std::to_string(timeout.count()) +
                                " ms (timeout; the call goes on)");
    }
  }
  if (state_.load() == 2) std::rethrow_exception(error_);
  return true;
}

int Op::source() const { return tasks_.empty() ? -1 : b_->api()->task_peer(tasks_.back()); }

Work::Work(std::shared_ptr<Op> op, c10d::OpType type) : c10d::Work(-1, type), op_(std::move(op)) {}

std::vector<at::Tensor> Work::result() {
  wait();
  return op_->value();
}

bool Work::wait(std::chrono::milliseconds timeout) { return op_->wait(timeout); }

GroupWork::GroupWork(std::vector<std::shared_ptr<Op>> ops)
    : c10d::Work(-1, c10d::OpType::COALESCED), ops_(std::move(ops)) {
  if (ops_.empty()) {
    fut_ = new_future();
    fut_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
  }
}

c10::intrusive_ptr<c10::ivalue::Future> GroupWork::getFuture() {
  // plait runs the ops in issue order: the last one's future stands for the group. Made on
  // request only, since taking it starts the calls (Op::future).
  return ops_.empty() ? fut_ : ops_.back()->future();
}

bool GroupWork::isCompleted() {
  for (auto& op : ops_)
    if (!op->poll()) return false;
  return true;
}

bool GroupWork::isSuccess() const {
  for (auto& op : ops_)
    if (!op->ok()) return false;
  return true;
}

std::exception_ptr GroupWork::exception() const {
  for (auto& op : ops_)
    if (op->error()) return op->error();
  return nullptr;
}

bool GroupWork::wait(std::chrono::milliseconds timeout) {
  for (auto& op : ops_) op->wait(timeout);
  return true;
}

}  // namespace plait_torch
