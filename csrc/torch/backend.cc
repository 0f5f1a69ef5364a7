// The plait c10d Backend: lifetime, errors, the completion thread, and the Python module that
// creates it (plait.torch._native loads this file's module and registers the backend).
#include "torch/backend.h"
#include "torch/engines.h"

#include <Python.h>
#include <c10/core/CPUAllocator.h>
#include <torch/python.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>

namespace plait_torch {

namespace {
thread_local const Backend* tl_completing = nullptr;  // the backend whose completion thread this is

const char* kind_name(uint32_t kind) {
  switch (kind) {
    case PLAIT_E_INVALID:
      return "InvalidArgument";
    case PLAIT_E_MISMATCH:
      return "MismatchError";
    case PLAIT_E_TIMEOUT:
      return "TimeoutError";
    case PLAIT_E_PEER_LOST:
      return "PeerLostError";
    case kUnsupported:
      return "UnsupportedError";
    default:
      return "PlaitError";
  }
}
}  // namespace

Backend::Backend(const plait_capi* api, void* comm, void* owner, int rank, int size,
                 double timeout_s)
    : c10d::Backend(rank, size), api_(api), comm_(comm), owner_(owner), timeout_s_(timeout_s) {
  Py_XINCREF(static_cast<PyObject*>(owner_));
}

Backend::~Backend() {
  shutdown();
  // The Python communicator goes with its last reference (not at interpreter exit: gone then).
  if (owner_ && Py_IsInitialized() && !_Py_IsFinalizing()) {
    PyGILState_STATE s = PyGILState_Ensure();
    Py_DECREF(static_cast<PyObject*>(owner_));
    PyGILState_Release(s);
  }
}

void Backend::shutdown() {
  if (closed_.exchange(true)) return;
  auto stop = [&] {
    finalize_gpu();
    api_->finalize(comm_);  // finishes queued calls; their completions reach the queue
    {
      std::lock_guard<std::mutex> lk(q_mu_);
      stop_ = true;
    }
    q_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  };
  // Future callbacks on the completion thread may need the GIL: never hold it while joining.
  if (Py_IsInitialized() && PyGILState_Check()) {
    Py_BEGIN_ALLOW_THREADS stop();
    Py_END_ALLOW_THREADS
  } else {
    stop();
  }
}

Error Backend::error(uint32_t kind, const std::string& where, const std::string& msg0) const {
  std::string msg = msg0;  // the core's send/recv reports name our internal tag: not the user's
  for (const char* sep : {"tag=", "tag "}) {
    const std::string tag = sep + std::to_string(kInternalTag);
    for (size_t at = msg.find(tag); at != std::string::npos; at = msg.find(tag, at))
      msg.replace(at, tag.size(), "plait's internal tag");
  }
  std::string text = where + ": " + kind_name(kind) + ": ";
  // torch's convention (gloo's, NCCL's): a timeout's text says " Timed out ".
  if (kind == PLAIT_E_TIMEOUT && msg.find("Timed out") == std::string::npos)
    text += "Timed out (timeout): ";
  return Error(kind, text + msg, getGroupUid());
}

std::string Backend::label(const std::string& what) const {
  return "plait " + what + " on group '" + getGroupUid() + "' (rank " + std::to_string(getRank()) +
         " of " + std::to_string(getSize()) + ")";
}

std::shared_ptr<Op> Backend::begin(const std::string& what, Tensors value, bool sync,
                                   std::chrono::milliseconds timeout, bool fusable) {
  if (!fusable && !fuse_.empty()) flush();  // issue order is call order
  if (closed_.load()) throw Error(PLAIT_E_GENERIC, label(what) + ": the group was shut down");
  auto op = std::make_shared<Op>(this, what, std::move(value));
  op->weak = op;
  op->sync = sync && !coalescing_;  // a coalesced op completes with the group
  op->timeout_s = timeout.count() > 0 ? double(timeout.count()) / 1000.0 : timeout_s_;
  // A Future callback issuing a call on this thread: nobody else would complete it here.
  op->waiter_completes = on_completion_thread();
  if (coalescing_) coalesced_.push_back(op);
  return op;
}

void Backend::startCoalescing() {
  coalescing_ = true;
  coalesced_.clear();
}

c10::intrusive_ptr<c10d::Work> Backend::endCoalescing() {
  flush();
  coalescing_ = false;
  return c10::make_intrusive<GroupWork>(std::move(coalesced_));
}

void Backend::fail(const std::string& msg) {
  char err[1024];
  const std::string m = "rank " + std::to_string(getRank()) + ": " + msg;
  uint32_t kind = api_->fail(comm_, PLAIT_E_INVALID, m.c_str(), err, sizeof err);
  throw error(kind, "plait on group '" + getGroupUid() + "'", err);
}

void Backend::unsupported(const Op& op, const std::string& msg) const {
  throw error(kUnsupported, op.where(), msg);
}

void Backend::monitoredBarrier(const c10d::BarrierOptions& o, bool /*wait_all_ranks*/) {
  c10d::BarrierOptions b = o;
  b.asyncOp = false;
  barrier(b)->wait();
}

c10::intrusive_ptr<c10d::Backend> Backend::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  auto me = std::find(ranks.begin(), ranks.end(), getRank());
  if (me == ranks.end()) return nullptr;  // only the new group's members rendezvous
  const double secs =
      opts && opts->timeout.count() > 0 ? double(opts->timeout.count()) / 1000.0 : timeout_s_;
  const std::string name = opts ? opts->group_name : std::string();
  // A new communicator rendezvouses through the store in plait.init (Python): once per split.
  pybind11::gil_scoped_acquire gil;
  pybind11::object made =
      pybind11::module_::import("plait.torch._native")
          .attr("split")(store, int(me - ranks.begin()), int(ranks.size()), secs, name);
  return made.cast<c10::intrusive_ptr<c10d::Backend>>();
}

namespace {
// A plait shared region held by a torch storage.
struct SharedRegion {
  const plait_capi* api;
  uint64_t id;
  void* ptr;
  size_t bytes;
};

// Regions whose tensors died, by size, for the next tensor of that size. FSDP2 allocates its
// all-gather and reduce-scatter buffers anew every step, in the same sizes: from the pool they
// are the same memory each step, which peers have mapped already, where a fresh region costs a
// memfd, an mmap here and one on every peer that reads it (an FSDP2 step of a 4x1024 MLP took
// 3x as long without the pool). Process-wide and never destroyed: tensors may outlive every
// backend.
class SharedPool {
 public:
  static constexpr size_t kPage = 4096;
  static constexpr size_t kMaxCached = size_t(512) << 20;  // bytes of idle regions kept

  c10::DataPtr get(const plait_capi* api, size_t bytes) {
    bytes = (std::max<size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
    SharedRegion* r = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = idle_.find(bytes);
      if (it != idle_.end() && it->second->api == api) {
        r = it->second;
        idle_.erase(it);
        cached_ -= bytes;
      }
    }
    if (!r) {
      uint64_t id = 0;
      void* p = api->shared_alloc(bytes, &id);
      if (!p) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
      r = new SharedRegion{api, id, p, bytes};
    }
    return c10::DataPtr(r->ptr, r, &SharedPool::put, c10::Device(c10::kCPU));
  }

  static bool owns(const c10::DataPtr& dp) { return dp.get_deleter() == &SharedPool::put; }
  static SharedPool& instance() {
    static SharedPool* pool = new SharedPool;  // never destroyed (see above)
    return *pool;
  }

 private:
  static void put(void* ctx) {
    auto* r = static_cast<SharedRegion*>(ctx);
    SharedPool& pool = instance();
    {
      std::lock_guard<std::mutex> lk(pool.mu_);
      if (pool.cached_ + r->bytes <= kMaxCached) {
        pool.idle_.emplace(r->bytes, r);
        pool.cached_ += r->bytes;
        return;
      }
    }
    r->api->shared_free(r->id);
    delete r;
  }

  std::mutex mu_;
  std::multimap<size_t, SharedRegion*> idle_;
  size_t cached_ = 0;
};

// `bytes` of plait shared memory as a DataPtr; empty when there is none left.
c10::DataPtr shared_data_ptr(const plait_capi* api, size_t bytes) {
  return SharedPool::instance().get(api, bytes);
}
}  // namespace

at::Tensor Backend::allocateTensor(long size, at::TensorOptions options) {
  if (options.device().is_cuda()) return at::empty({size}, options);  // peers map host memory
  const size_t bytes = size_t(std::max<long>(size, 0)) *
                       c10::elementSize(c10::typeMetaToScalarType(options.dtype()));
  c10::DataPtr dp = shared_data_ptr(api_, bytes);
  if (!dp) return at::empty({size}, options.device(at::kCPU));  // out of shared memory: private
  c10::Storage st(c10::Storage::use_byte_size_t(), bytes, std::move(dp), nullptr, false);
  return at::empty({0}, options.device(at::kCPU)).set_(st, 0, {size}, {1});
}

bool share_storage(const at::Tensor& t, const plait_capi* api) {
  if (!t.defined() || t.device().type() != c10::kCPU || t.is_sparse() || !t.has_storage())
    return false;
  c10::StorageImpl* st = t.storage().unsafeGetStorageImpl();
  if (SharedPool::owns(st->data_ptr())) return true;  // plait's already
  // Only memory torch's own CPU allocator handed out moves: a from_numpy, mmap'ed (torch.load
  // mmap=True), pinned or foreign buffer is somebody else's to free.
  if (st->nbytes() == 0 ||
      st->data_ptr().get_deleter() != c10::GetDefaultCPUAllocator()->raw_deleter())
    return false;
  c10::DataPtr dp = shared_data_ptr(api, st->nbytes());
  if (!dp) return false;
  std::memcpy(dp.get(), st->data(), st->nbytes());
  st->set_data_ptr_noswap(std::move(dp));  // frees the old memory
  return true;
}

bool Backend::on_completion_thread() const { return tl_completing == this; }

void Backend::post(std::shared_ptr<Op> op) {
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    queue_.push_back(std::move(op));
    if (!thread_.joinable()) thread_ = std::thread([this] { completion_loop(); });
  }
  q_cv_.notify_one();
}

void Backend::completion_loop() {
  tl_completing = this;
  for (;;) {
    std::shared_ptr<Op> op;
    {
      std::unique_lock<std::mutex> lk(q_mu_);
      q_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    op->complete();
  }
}

}  // namespace plait_torch

namespace py = pybind11;

namespace plait_torch {
void bind_testing(py::module_& m);  // testing.cc: the recording CUDA device of CPU tests
void bind_horovod(py::module_& m);  // horovod.cc: plait.horovod's grouped copies
}  // namespace plait_torch

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::module_::import("torch.distributed");
  plait_torch::bind_testing(m);
  m.attr("CAPI_VERSION") = PLAIT_CAPI_VERSION;
  plait_torch::bind_gloo_engine(m);
  plait_torch::bind_engine_calls(m);
  plait_torch::bind_horovod(m);
  // Moves a CPU tensor's storage into plait shared memory in place, as Tensor.share_memory_()
  // moves one into torch's: every tensor and view on the storage then sees the new memory, and
  // plait's peers map it. The old memory is freed: a raw pointer to it taken earlier (a numpy
  // view) would dangle, so this is only for buffers plait's caller owns (DDP's buckets).
  m.def("share_storage", [](const at::Tensor& t, py::capsule api) {
    if (std::string(api.name()) != PLAIT_CAPI_CAPSULE)
      throw std::runtime_error("not plait._C's C API");
    return plait_torch::share_storage(t, static_cast<const plait_capi*>(api.get_pointer()));
  });
  m.def("create", [](py::capsule api, py::capsule comm, py::object owner, int rank, int size,
                     double timeout_s) {
    auto* table = static_cast<const plait_capi*>(api.get_pointer());
    if (std::string(api.name()) != PLAIT_CAPI_CAPSULE || table->version != PLAIT_CAPI_VERSION)
      throw std::runtime_error("plait._C's C API does not match this build of the torch backend");
    if (std::string(comm.name()) != PLAIT_COMM_CAPSULE)
      throw std::runtime_error("not a plait communicator");
    return c10::intrusive_ptr<c10d::Backend>(c10::make_intrusive<plait_torch::Backend>(
        table, comm.get_pointer(), owner.ptr(), rank, size, timeout_s));
  });
  // plait's error kinds onto plait.torch's classes (each a DistBackendError and plait's class).
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const plait_torch::Error& e) {
      const char* cls = "PlaitBackendError";
      switch (e.kind()) {
        case PLAIT_E_INVALID:
          cls = "PlaitInvalidArgument";
          break;
        case PLAIT_E_MISMATCH:
          cls = "PlaitMismatchError";
          break;
        case PLAIT_E_TIMEOUT:
          cls = "PlaitTimeoutError";
          break;
        case PLAIT_E_PEER_LOST:
          cls = "PlaitPeerLostError";
          break;
        case plait_torch::kUnsupported:
          cls = "PlaitUnsupportedError";
          break;
        default:
          break;
      }
      py::object errors = py::module_::import("plait.torch._errors");
      py::object type = errors.attr(cls);
      try {  // as plait's own errors: the flight report of a mismatch, timeout or lost peer
        py::object exc = type(e.what_without_backtrace());
        errors.attr("attach_flight")(exc, e.group(), e.kind());
        PyErr_SetObject(type.ptr(), exc.ptr());
      } catch (py::error_already_set&) {
        PyErr_SetString(type.ptr(), e.what_without_backtrace());
      }
    }
  });
}
