// CUDA tensors through the plait backend. A torch call's plait calls take the C API's device
// buffers: the communicator's GPU queue enqueues them on the current stream of the tensors'
// device and returns. Like c10d's NCCL backend the op then completes in stream order, but on the
// caller's own stream (NCCL's runs on a side stream it must first make wait for the caller's):
// an event is recorded there after the calls and the op's steps (torch enqueues those on the same
// stream); Work.wait() makes the caller's current stream wait for that event while the host goes
// on, isCompleted() queries it, and the Future is CUDA-aware (it records its own events on the
// op's stream when marked complete). Each tensor plait is handed is recorded on its device's
// current stream (as Tensor.record_stream does), so torch's caching allocator does not give its
// memory out again before the call has run there.
//
// Only torch's device-generic stream and event API is used (c10::Stream, c10::Event,
// c10::impl::VirtualGuardImpl), so this compiles against a CPU-only torch, where a test installs
// a recording CUDA device (testing.cc) and drives this code end to end.
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "torch/backend.h"

namespace plait_torch {

namespace {
// capi.h's collective codes, named as plait names them (plait._gpu's checks take the names).
const char* const kCollNames[] = {"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
                                  "alltoall",  "barrier",        "send",      "recv"};

c10::impl::VirtualGuardImpl cuda_impl() {
  // Looked up at each use: a test may install its CUDA device after this module loaded.
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA);
}
}  // namespace

c10::Stream current_stream(c10::Device d) { return cuda_impl().getStream(d); }

void Op::keep(const at::Tensor& t) {
  keep_.push_back(t);
  if (t.is_cuda() && t.has_storage()) {
    auto impl = cuda_impl();
    impl.recordDataPtrOnStream(t.storage().data_ptr(), impl.getStream(t.device()));
  }
}

void Op::issue_gpu(uint8_t coll, const plait_buffer* in, const plait_buffer* out, uint8_t op,
                   int root, int peer, int64_t tag) {
  if (!tasks_.empty() || outstanding_.load(std::memory_order_acquire) > 1)
    b_->fail(what_ + ": CPU and CUDA tensors in one call; pass all of them on one device");
  const plait_buffer& any = in && in->present ? *in : *out;
  b_->ensure_gpu(*this, coll, any.device_index);
  if (!gpu_)
    gpu_ = std::make_unique<GpuOp>(
        current_stream(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(any.device_index))));
  const auto stream = reinterpret_cast<uintptr_t>(cuda_impl().getStreamNativeHandle(gpu_->stream));
  plait_buffer i{}, o{};
  if (in) i = *in, i.stream = stream;
  if (out) o = *out, o.stream = stream;
  // GPU send/recv have no tags (NCCL matches them in issue order per pair of ranks): the internal
  // tag of all-to-all, gather and scatter is dropped; a user's tag reaches plait, which refuses it
  // on every rank.
  if (tag == kInternalTag) tag = 0;
  char err[1024];
  const uint32_t kind =
      b_->api()->call(b_->comm(), coll, in ? &i : nullptr, out ? &o : nullptr, op, root, peer, tag,
                      "auto", timeout_s, nullptr, nullptr, nullptr, err, sizeof err);
  if (kind) throw b_->error(kind, where(), err);
}

c10::intrusive_ptr<c10d::Work> Op::launch_gpu() {
  auto me = weak.lock();
  outstanding_.fetch_sub(1, std::memory_order_acq_rel);
  run_steps();  // enqueued by torch on the current stream: after the calls
  gpu_->event = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
  gpu_->event->record(gpu_->stream);
  {
    std::lock_guard<std::mutex> lk(mu_);
    state_.store(kind_ ? 2 : 1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& f : followers_) f->release(kind_, msg_.c_str());
  followers_.clear();
  if (sync && state_.load() == 2) std::rethrow_exception(error_);
  return c10::make_intrusive<Work>(me, c10d::OpType::UNKNOWN);
}

c10::intrusive_ptr<c10::ivalue::Future> Op::gpu_future() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!fut_) {
    static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
    fut_ = c10::make_intrusive<c10::ivalue::Future>(
        type, std::vector<c10::Device>{gpu_->stream.device()});
    if (state_.load(std::memory_order_acquire) == 2) {
      fut_->setError(error_);
    } else {  // its events go on the op's stream, whichever stream is current here
      c10::StreamGuard guard(gpu_->stream);
      fut_->markCompleted(c10::IValue(value_));
    }
  }
  return fut_;
}

void Op::wait_gpu(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto pause = std::chrono::microseconds(20);
  while (!gpu_->event->query()) {
    if (std::chrono::steady_clock::now() >= deadline)
      throw Error(kTimeout, where() + ": Work.wait Timed out after " +
                                std::to_string(timeout.count()) +
                                " ms while the GPU ran the call (timeout; the call goes on)");
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));  // queries are cheap, not free
  }
}

void Op::block_current_stream() {
  if (gpu_ && gpu_->event) gpu_->event->block(current_stream(gpu_->stream.device()));
}

void Backend::same_device(const Op& op, const at::Tensor& in, const at::Tensor& out) {
  on_device(op, in);
  on_device(op, out);
  if (in.device() != out.device())
    fail(op.what_ + ": input on " + in.device().str() + ", output on " + out.device().str() +
         "; pass both on one device");
}

void Backend::one_device(const Op& op, const Tensors& a, const Tensors& b) {
  const at::Tensor* first = nullptr;
  for (const Tensors* ts : {&a, &b})
    for (const auto& t : *ts) {
      on_device(op, t);
      if (!first) first = &t;
      if (t.device() != first->device())
        fail(op.what_ + ": tensors on " + first->device().str() + " and " + t.device().str() +
             " in one call; pass all of them on one device");
    }
}

void Backend::ensure_gpu(const Op& op, uint8_t coll, int device) {
  if (gpu_device_.load(std::memory_order_acquire) == device) return;
  std::lock_guard<std::mutex> lk(gpu_mu_);
  const int have = gpu_device_.load(std::memory_order_acquire);
  if (have == device) return;
  if (have >= 0)
    fail(op.what_ + ": a CUDA tensor on GPU " + std::to_string(device) +
         ", but this group's GPU work runs on GPU " + std::to_string(have) +
         " (every CUDA tensor a rank passes to one group must be on one GPU)");
  uint32_t kind = PLAIT_E_GENERIC;
  std::string msg;
  {
    // Once per group: the queue is made by Python (plait._gpu), collectively, in this call.
    pybind11::gil_scoped_acquire gil;
    try {
      pybind11::tuple r = pybind11::module_::import("plait.torch._native")
                              .attr("attach_gpu")(pybind11::handle(static_cast<PyObject*>(owner_)),
                                                  kCollNames[coll], device, timeout_s_);
      kind = r[0].cast<uint32_t>();
      msg = r[1].cast<std::string>();
    } catch (pybind11::error_already_set& e) {
      msg = e.what();
    }
  }
  if (kind) throw error(kind, op.where(), msg);
  gpu_device_.store(device, std::memory_order_release);
}

void Backend::finalize_gpu() {
  // At interpreter exit plait._gpu's atexit hook has finalized the queue already.
  if (gpu_device_.load(std::memory_order_acquire) < 0 || !Py_IsInitialized() || _Py_IsFinalizing())
    return;
  pybind11::gil_scoped_acquire gil;
  try {  // the queue, then (idempotent) the communicator; a failed one has nothing to drain
    pybind11::handle(static_cast<PyObject*>(owner_)).attr("finalize")();
  } catch (pybind11::error_already_set&) {
  }
}

}  // namespace plait_torch
