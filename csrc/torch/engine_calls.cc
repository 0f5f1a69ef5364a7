// Test-only: an engine's functions (hier/engine.h) called on numpy arrays from Python, so the
// engines are tested on their own, before and apart from the multi-host communicator. Any
// engine capsule works (gloo's from this module, MPI's from plait._mpi). Each call releases the
// GIL, as the communicator calls engines, and raises plait's exception for the kind returned.
#include <pybind11/pybind11.h>

#include <cmath>
#include <string>

#include "bindings/capi.h"
#include "hier/engine.h"
#include "torch/engines.h"

namespace py = pybind11;

namespace plait_torch {
namespace {

constexpr size_t kErrLen = 2048;
const char* const kReqCapsule = "plait.engine.request";
const char* const kSpent = "plait.engine.spent";  // a released engine's, a waited request's name

plait_engine* engine(const py::capsule& c) {
  if (std::string(c.name() ? c.name() : "") != PLAIT_ENGINE_CAPSULE)
    throw py::value_error("not an engine capsule (" PLAIT_ENGINE_CAPSULE ")");
  auto* e = static_cast<plait_engine*>(c.get_pointer());
  if (e == nullptr || e->version != PLAIT_ENGINE_VERSION) throw py::value_error("engine released");
  return e;
}

struct Bytes {
  void* ptr;
  size_t bytes;
};

Bytes bytes_of(const py::buffer& b, bool writable) {
  py::buffer_info i = b.request(writable);
  size_t n = static_cast<size_t>(i.itemsize);
  for (py::ssize_t d = i.ndim - 1; d >= 0; --d) {
    if (i.strides[d] != static_cast<py::ssize_t>(n)) throw py::value_error("buffer not contiguous");
    n *= static_cast<size_t>(i.shape[d]);
  }
  return {i.ptr, n};
}

// Raises plait's class for an engine's error kind (the message is the engine's).
void check(uint32_t kind, const char* err) {
  if (kind == PLAIT_OK) return;
  static const char* kClasses[] = {"PlaitError",    "PlaitError",   "InvalidArgument",
                                   "MismatchError", "TimeoutError", "PeerLostError"};
  py::object cls =
      py::module_::import("plait._errors").attr(kind <= 5 ? kClasses[kind] : "PlaitError");
  PyErr_SetString(cls.ptr(), err);
  throw py::error_already_set();
}

template <class F>
void call(F f) {
  char err[kErrLen] = {0};
  uint32_t k;
  {
    py::gil_scoped_release nogil;
    k = f(err);
  }
  check(k, err);
}

}  // namespace

void bind_engine_calls(py::module_& m) {
  m.def("_engine_info", [](py::capsule c) {
    plait_engine* e = engine(c);
    return py::make_tuple(std::string(e->name), e->rank, e->size);
  });
  m.def("_engine_supports", [](py::capsule c, int dtype, int op) {
    plait_engine* e = engine(c);
    return e->supports(e->ctx, static_cast<uint8_t>(dtype), static_cast<uint8_t>(op)) != 0;
  });
  m.def("_engine_allreduce", [](py::capsule c, py::buffer buf, int dtype, int op, double to) {
    plait_engine* e = engine(c);
    Bytes b = bytes_of(buf, true);
    size_t item = py::buffer(buf).request().itemsize;
    call([&](char* err) {
      return e->allreduce(e->ctx, b.ptr, b.bytes / item, static_cast<uint8_t>(dtype),
                          static_cast<uint8_t>(op), to, err, kErrLen);
    });
  });
  m.def("_engine_allgather", [](py::capsule c, py::buffer in, py::buffer out, double to) {
    plait_engine* e = engine(c);
    Bytes i = bytes_of(in, false), o = bytes_of(out, true);
    if (o.bytes != i.bytes * static_cast<size_t>(e->size)) throw py::value_error("out: size * in");
    call([&](char* err) { return e->allgather(e->ctx, i.ptr, o.ptr, i.bytes, to, err, kErrLen); });
  });
  // Returns the request; buf must stay alive until _engine_wait returns.
  m.def("_engine_allreduce_start", [](py::capsule c, py::buffer buf, int dtype, int op, double to) {
    plait_engine* e = engine(c);
    if (!PLAIT_ENGINE_HAS(e, allreduce_start)) throw py::value_error("no allreduce_start");
    Bytes b = bytes_of(buf, true);
    size_t item = py::buffer(buf).request().itemsize;
    void* req = nullptr;
    call([&](char* err) {
      return e->allreduce_start(e->ctx, b.ptr, b.bytes / item, static_cast<uint8_t>(dtype),
                                static_cast<uint8_t>(op), to, &req, err, kErrLen);
    });
    return py::capsule(req, kReqCapsule);
  });
  // Returns the request; in and out must stay alive until _engine_wait returns.
  m.def("_engine_allgather_start", [](py::capsule c, py::buffer in, py::buffer out) {
    plait_engine* e = engine(c);
    Bytes i = bytes_of(in, false), o = bytes_of(out, true);
    if (o.bytes != i.bytes * static_cast<size_t>(e->size)) throw py::value_error("out: size * in");
    void* req = nullptr;
    call([&](char* err) {
      return e->allgather_start(e->ctx, i.ptr, o.ptr, i.bytes, &req, err, kErrLen);
    });
    return py::capsule(req, kReqCapsule);
  });
  m.def("_engine_wait", [](py::capsule c, py::capsule req, double to) {
    plait_engine* e = engine(c);
    if (std::string(req.name() ? req.name() : "") != kReqCapsule)
      throw py::value_error("not a pending request (each is waited once)");
    void* r = req.get_pointer();
    PyCapsule_SetName(req.ptr(), kSpent);
    call([&](char* err) { return e->wait(e->ctx, r, to, err, kErrLen); });
  });
  m.def("_engine_broadcast", [](py::capsule c, py::buffer buf, int root, double to) {
    plait_engine* e = engine(c);
    Bytes b = bytes_of(buf, true);
    call([&](char* err) { return e->broadcast(e->ctx, b.ptr, b.bytes, root, to, err, kErrLen); });
  });
  m.def("_engine_alltoall", [](py::capsule c, py::buffer in, py::buffer out, double to) {
    plait_engine* e = engine(c);
    Bytes i = bytes_of(in, false), o = bytes_of(out, true);
    if (o.bytes != i.bytes || i.bytes % static_cast<size_t>(e->size) != 0)
      throw py::value_error("in and out: size equal blocks each");
    size_t block = i.bytes / static_cast<size_t>(e->size);
    call([&](char* err) { return e->alltoall(e->ctx, i.ptr, o.ptr, block, to, err, kErrLen); });
  });
  m.def("_engine_send", [](py::capsule c, py::buffer buf, int peer, int tag, double to) {
    plait_engine* e = engine(c);
    Bytes b = bytes_of(buf, false);
    call([&](char* err) { return e->send(e->ctx, b.ptr, b.bytes, peer, tag, to, err, kErrLen); });
  });
  m.def("_engine_recv", [](py::capsule c, py::buffer buf, int peer, int tag, double to) {
    plait_engine* e = engine(c);
    Bytes b = bytes_of(buf, true);
    call([&](char* err) { return e->recv(e->ctx, b.ptr, b.bytes, peer, tag, to, err, kErrLen); });
  });
  // (src, bytes) of a message of tag ready to receive, (-1, 0) when none; bytes None when the
  // engine cannot tell before receiving it.
  m.def("_engine_probe", [](py::capsule c, int tag) -> py::tuple {
    plait_engine* e = engine(c);
    if (!PLAIT_ENGINE_HAS(e, probe)) throw py::value_error("this engine has no probe");
    int src = -1;
    size_t n = 0;
    call([&](char* err) { return e->probe(e->ctx, tag, &src, &n, err, kErrLen); });
    if (n == PLAIT_ENGINE_UNKNOWN) return py::make_tuple(src, py::none());
    return py::make_tuple(src, n);
  });
  // engine.h's p2p_start: the request (buf must stay alive until _engine_p2p_test says done).
  m.def("_engine_p2p_start", [](py::capsule c, bool send, py::buffer buf, int peer, int tag,
                                double to) {
    plait_engine* e = engine(c);
    if (!PLAIT_ENGINE_HAS(e, p2p_start)) throw py::value_error("this engine has no p2p_start");
    Bytes b = bytes_of(buf, !send);
    void* req = nullptr;
    call([&](char* err) {
      return e->p2p_start(e->ctx, send ? 1 : 0, b.ptr, b.bytes, peer, tag, to, &req, err, kErrLen);
    });
    return py::capsule(req, kReqCapsule);
  });
  // True once the request finished (then it is spent; its error raised), False while it runs.
  m.def("_engine_p2p_test", [](py::capsule c, py::capsule req) {
    plait_engine* e = engine(c);
    if (std::string(req.name() ? req.name() : "") != kReqCapsule)
      throw py::value_error("not a pending request (each finishes once)");
    void* r = req.get_pointer();
    int done = 0;
    try {
      call([&](char* err) { return e->p2p_test(e->ctx, r, &done, err, kErrLen); });
    } catch (...) {
      PyCapsule_SetName(req.ptr(), kSpent);
      throw;
    }
    if (done) PyCapsule_SetName(req.ptr(), kSpent);
    return done != 0;
  });
  m.def("_engine_fail", [](py::capsule c, int kind, const std::string& msg) {
    plait_engine* e = engine(c);
    py::gil_scoped_release nogil;
    e->fail(e->ctx, static_cast<uint32_t>(kind), msg.c_str());
  });
  // Frees the engine (what the communicator owning a capsule does once); the capsule is void after.
  m.def("_engine_release", [](py::capsule c) {
    plait_engine* e = engine(c);
    PyCapsule_SetName(c.ptr(), kSpent);
    py::gil_scoped_release nogil;
    e->release(e->ctx);
  });
}

}  // namespace plait_torch
