// _C._py_engine(group): an engine (hier/engine.h) over a Python object with plait._inter's group
// methods (GlooGroup, MpiGroup), so the multi-host communicator runs before, and without, the
// native engines. Each call takes the GIL for its duration; the group's own waits poll the job's
// abort flag. A Python error becomes its plait error kind; a PeerLostError raised because the
// job-wide flag is set becomes the kind of the failure the flag records (a mismatch stays a
// MismatchError on every host).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <string>

#include "bindings/capi.h"
#include "core/errors.h"
#include "core/types.h"
#include "hier/engine.h"

namespace py = pybind11;

namespace plait {
namespace {

struct PyEngine {
  plait_engine e{};
  py::object group;
  std::string name;
  bool gloo = false;
  bool failed = false;
};

PyEngine& self(void* ctx) { return *static_cast<PyEngine*>(ctx); }

double deadline(double timeout_s) {
  if (std::isinf(timeout_s)) return timeout_s;
  return py::module_::import("time").attr("monotonic")().cast<double>() + timeout_s;
}

uint32_t kind_of(const py::handle& exc) {
  py::module_ errors = py::module_::import("plait._errors");
  const std::pair<const char*, ErrorKind> kinds[] = {{"MismatchError", ErrorKind::mismatch},
                                                     {"InvalidArgument", ErrorKind::invalid},
                                                     {"TimeoutError", ErrorKind::timeout},
                                                     {"PeerLostError", ErrorKind::peer_lost}};
  for (const auto& k : kinds)
    if (py::isinstance(exc, errors.attr(k.first))) return uint32_t(k.second);
  return uint32_t(ErrorKind::generic);
}

// Runs fn with the GIL; a Python exception becomes (kind, message in err).
template <class F>
uint32_t guarded(void* ctx, char* err, size_t errlen, F&& fn) {
  py::gil_scoped_acquire gil;
  try {
    fn(self(ctx));
    return PLAIT_OK;
  } catch (py::error_already_set& e) {
    uint32_t kind = kind_of(e.value());
    std::string msg = py::str(e.value()).cast<std::string>();
    if (kind == uint32_t(ErrorKind::peer_lost)) {
      // Ended by the job-wide flag: raise what the first failure was.
      try {
        py::object origin = self(ctx).group.attr("_abort").attr("origin")();
        if (!origin.is_none()) {
          kind = kind_of(origin[py::int_(0)](""));
          msg = "aborted because another rank failed: " +
                py::str(origin[py::int_(1)]).cast<std::string>();
        }
      } catch (py::error_already_set&) {
      }
    }
    if (errlen) {
      std::strncpy(err, msg.c_str(), errlen - 1);
      err[errlen - 1] = 0;
    }
    return kind;
  }
}

py::array bytes_view(const void* p, size_t n) {
  // No copy and no owner: the engine contract keeps the memory valid for the call.
  return py::array(py::dtype("uint8"), {py::ssize_t(n)}, {py::ssize_t(1)}, p, py::none());
}

const char* np_name(DType dt) {
  switch (dt) {
    case DType::f16:
      return "float16";
    case DType::bf16:
      return "uint16";  // bfloat16 bits; the group is told (bf16=True)
    case DType::boolean:
      return "bool";
    default:
      return dtype_name(dt);
  }
}

int e_supports(void* ctx, uint8_t dtype, uint8_t op) {
  const DType dt = DType(dtype);
  if (dt == DType::boolean || RedOp(op) == RedOp::avg) return 0;
  // gloo reduces every other plait type; MPI has no half types
  return self(ctx).gloo || !(dt == DType::f16 || dt == DType::bf16);
}

uint32_t e_allreduce(void* ctx, void* buf, size_t count, uint8_t dtype, uint8_t op,
                     double timeout_s, char* err, size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    const DType dt = DType(dtype);
    py::array a(py::dtype(np_name(dt)), {py::ssize_t(count)}, {py::ssize_t(dtype_size(dt))}, buf,
                py::none());
    s.group.attr("allreduce")(a, op_name(RedOp(op)), deadline(timeout_s), dt == DType::bf16);
  });
}

uint32_t e_allgather(void* ctx, const void* in, void* out, size_t bytes, double timeout_s,
                     char* err, size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    s.group.attr("allgather")(bytes_view(in, bytes), bytes_view(out, bytes * size_t(s.e.size)),
                              deadline(timeout_s));
  });
}

uint32_t e_allgather_start(void* ctx, const void* in, void* out, size_t bytes, void** req,
                           char* err, size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    py::object w = s.group.attr("allgather_begin")(bytes_view(in, bytes),
                                                   bytes_view(out, bytes * size_t(s.e.size)));
    *req = w.release().ptr();
  });
}

uint32_t e_wait(void* ctx, void* req, double timeout_s, char* err, size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine&) {
    py::object w = py::reinterpret_steal<py::object>(static_cast<PyObject*>(req));
    w.attr("wait")(deadline(timeout_s));
  });
}

uint32_t e_broadcast(void* ctx, void* buf, size_t bytes, int root, double timeout_s, char* err,
                     size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    s.group.attr("broadcast")(bytes_view(buf, bytes), root, deadline(timeout_s));
  });
}

uint32_t e_alltoall(void* ctx, const void* in, void* out, size_t bytes, double timeout_s, char* err,
                    size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    const size_t total = bytes * size_t(s.e.size);
    s.group.attr("alltoall")(bytes_view(in, total), bytes_view(out, total), deadline(timeout_s));
  });
}

uint32_t e_send(void* ctx, const void* buf, size_t bytes, int peer, int tag, double timeout_s,
                char* err, size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    s.group.attr("send")(bytes_view(buf, bytes), peer, tag, deadline(timeout_s));
  });
}

uint32_t e_recv(void* ctx, void* buf, size_t bytes, int peer, int tag, double timeout_s, char* err,
                size_t errlen) {
  return guarded(ctx, err, errlen, [&](PyEngine& s) {
    s.group.attr("recv")(bytes_view(buf, bytes), peer, tag, deadline(timeout_s));
  });
}

void e_fail(void* ctx, uint32_t kind, const char* msg) {
  py::gil_scoped_acquire gil;
  PyEngine& s = self(ctx);
  s.failed = true;
  try {
    s.group.attr("fail")(kind, msg);
  } catch (py::error_already_set&) {
    // the flag's store may be gone with its host; the peers then see that
  }
}

void e_release(void* ctx) {
  if (!Py_IsInitialized()) return;  // at exit: the interpreter took the group with it
  py::gil_scoped_acquire gil;
  auto* s = static_cast<PyEngine*>(ctx);
  try {
    s->group.attr("close")(s->failed);
  } catch (py::error_already_set&) {
  }
  delete s;
}

}  // namespace

void bind_py_engine(py::module_& m) {
  m.def(
      "_py_engine",
      [](py::object group) {
        auto* s = new PyEngine;
        s->group = group;
        s->name = py::str(group.attr("engine")).cast<std::string>();
        s->gloo = s->name == "gloo";
        plait_engine& e = s->e;
        e.version = PLAIT_ENGINE_VERSION;
        e.struct_size = sizeof(plait_engine);
        e.name = s->name.c_str();
        e.rank = group.attr("rank").cast<int>();
        e.size = group.attr("size").cast<int>();
        e.ctx = s;
        e.supports = e_supports;
        e.allreduce = e_allreduce;
        e.allgather = e_allgather;
        e.allgather_start = e_allgather_start;
        e.wait = e_wait;
        e.broadcast = e_broadcast;
        e.alltoall = e_alltoall;
        e.send = e_send;
        e.recv = e_recv;
        e.fail = e_fail;
        e.release = e_release;
        // allreduce_start stays NULL: a started call would hold the GIL in Python's wait anyway,
        // so the communicator calls allreduce, unpipelined. probe stays NULL too: plait._inter's
        // groups have no probe, so a receive from any rank across hosts is refused on them.
        return py::capsule(static_cast<void*>(&e), PLAIT_ENGINE_CAPSULE);
      },
      py::arg("group"),
      "An engine capsule (hier/engine.h) over a plait._inter group, for _C.HierComm, which "
      "owns it from then on.");
}

}  // namespace plait
