// The C table of capi.h over the one communicator interface (core/comm.h), and its two Python
// handles: plait._C._capi (the table) and plait._C._comm_capsule(communicator) (a communicator for
// native callers).
#include "bindings/capi.h"

#include <pybind11/pybind11.h>

#include <cstring>

#include "core/comm.h"
#include "transport/shared_mem.h"

namespace py = pybind11;

namespace plait {
namespace {

static_assert(int(Coll::recv) == PLAIT_RECV && int(Coll::barrier) == PLAIT_BARRIER,
              "capi.h coll codes");
static_assert(int(DType::boolean) == PLAIT_BOOL && int(DType::i64) == PLAIT_I64,
              "capi.h dtype codes");
static_assert(int(RedOp::avg) == PLAIT_AVG, "capi.h op codes");
static_assert(kAnySource == PLAIT_ANY_SOURCE, "capi.h any-source code");
static_assert(int(Device::cuda) == PLAIT_CUDA && int(Device::cpu) == PLAIT_HOST,
              "capi.h device codes");
static_assert(int(ErrorKind::peer_lost) == PLAIT_E_PEER_LOST &&
                  int(ErrorKind::timeout) == PLAIT_E_TIMEOUT,
              "capi.h error codes");

uint32_t report(const std::exception& e, char* err, size_t errlen) {
  if (err && errlen) {
    std::strncpy(err, e.what(), errlen - 1);
    err[errlen - 1] = '\0';
  }
  auto* pe = dynamic_cast<const PlaitError*>(&e);
  return pe ? uint32_t(pe->kind()) : uint32_t(ErrorKind::generic);
}

Buffer to_buffer(const plait_buffer* b) {
  Buffer r;
  if (!b || !b->present) return r;
  r.ptr = b->ptr;
  r.bytes = b->bytes;
  r.dtype = DType(b->dtype);
  r.writable = b->writable != 0;
  r.present = true;
  if (b->device == PLAIT_CUDA) {
    r.device = Device::cuda;
    r.device_index = b->device_index;
    r.stream = b->stream;
  }
  return r;
}

int c_rank(void* c) { return static_cast<Comm*>(c)->rank(); }
int c_size(void* c) { return static_cast<Comm*>(c)->size(); }

uint32_t c_call(void* comm, uint8_t coll, const plait_buffer* in, const plait_buffer* out,
                uint8_t op, int root, int peer, int64_t tag, const char* algo, double timeout_s,
                plait_done_fn done, void* ctx, void** task, char* err, size_t errlen) {
  auto& c = *static_cast<Comm*>(comm);
  try {
    if (coll >= uint8_t(Coll::kCount) ||
        (in && in->present && in->dtype >= uint8_t(DType::kCount)) ||
        (out && out->present && out->dtype >= uint8_t(DType::kCount)) ||
        (in && in->present && in->device > PLAIT_CUDA) ||
        (out && out->present && out->device > PLAIT_CUDA))
      // As any rejected argument: aborts every rank, so no peer waits for this call.
      c.fail(ErrorKind::invalid, "rank " + std::to_string(c.rank()) + ": C API call: bad " +
                                     "collective (" + std::to_string(coll) +
                                     "), dtype or device code");
    Task::Done hook;
    if (done)
      hook = [done, ctx](ErrorKind k, const std::string& m) { done(ctx, uint32_t(k), m.c_str()); };
    auto t =
        c.call(Coll(coll), to_buffer(in), to_buffer(out), RedOp(op), root, peer, tag,
               algo ? algo : "", timeout_s < 0 ? std::nullopt : std::optional<double>(timeout_s),
               done != nullptr, std::move(hook));
    if (task) *task = t ? new std::shared_ptr<Task>(std::move(t)) : nullptr;
    return 0;
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
}

uint32_t c_fail(void* comm, uint32_t kind, const char* msg, char* err, size_t errlen) {
  try {
    static_cast<Comm*>(comm)->fail(ErrorKind(kind), msg);
  } catch (const std::exception& e) {
    return report(e, err, errlen);
  }
}

int c_task_run(void* comm, void* task) {
  try {
    return static_cast<Comm*>(comm)->run_here(*static_cast<std::shared_ptr<Task>*>(task));
  } catch (...) {
    return 0;
  }
}

int c_task_peer(void* task) { return (*static_cast<std::shared_ptr<Task>*>(task))->peer(); }

void c_task_start(void* task) { (*static_cast<std::shared_ptr<Task>*>(task))->start(); }

void c_task_release(void* task) { delete static_cast<std::shared_ptr<Task>*>(task); }

void c_finalize(void* comm) { static_cast<Comm*>(comm)->finalize(); }

void* c_shared_alloc(size_t bytes, uint64_t* id) {
  try {
    return shared_alloc(bytes, id);
  } catch (...) {
    return nullptr;
  }
}

const plait_capi kTable = {
    PLAIT_CAPI_VERSION, sizeof(plait_capi), c_rank,     c_size,      c_call,         c_fail,
    c_task_run,         c_task_release,     c_finalize, c_task_peer, c_shared_alloc, shared_free,
    c_task_start};

}  // namespace

void bind_capi(py::module_& m) {
  m.attr("_capi") = py::capsule(static_cast<const void*>(&kTable), PLAIT_CAPI_CAPSULE);
  // The communicator stays owned by its Python object: callers keep that alive while they use it.
  m.def("_comm_capsule",
        [](Comm& c) { return py::capsule(static_cast<void*>(&c), PLAIT_COMM_CAPSULE); });
}

}  // namespace plait
