// plait._mpi: the MPI engine (hier/mpi_engine.h) handed to Python as an engine capsule, made from
// an mpi4py communicator, plus EngineForTests, which calls an engine's functions on numpy arrays
// (tests/test_mpi_engine.py; any engine capsule works, so the gloo one can be checked the same
// way).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "bindings/capi.h"
#include "hier/mpi_engine.h"

namespace py = pybind11;

namespace plait {
namespace {

[[noreturn]] void raise(uint32_t kind, const std::string& msg) {
  const char* cls = kind == PLAIT_E_INVALID     ? "InvalidArgument"
                    : kind == PLAIT_E_MISMATCH  ? "MismatchError"
                    : kind == PLAIT_E_TIMEOUT   ? "TimeoutError"
                    : kind == PLAIT_E_PEER_LOST ? "PeerLostError"
                                                : "PlaitError";
  py::object type = py::module_::import("plait._errors").attr(cls);
  PyErr_SetString(type.ptr(), msg.c_str());
  throw py::error_already_set();
}

std::string library_version() {
  char v[MPI_MAX_LIBRARY_VERSION_STRING];
  int n = 0;
  MPI_Get_library_version(v, &n);
  return std::string(v, n);
}

// A handle as mpi4py gives it: a pointer (Open MPI) or an int (MPICH).
template <class H>
H from_handle(unsigned long long h) {
  if constexpr (std::is_pointer<H>::value)
    return reinterpret_cast<H>(static_cast<uintptr_t>(h));
  else
    return static_cast<H>(h);
}

// The MPI_Comm behind an mpi4py communicator, after checking that mpi4py runs on the libmpi this
// module links (the same library loaded once: its MPI_COMM_WORLD is the same object).
MPI_Comm comm_of(const py::object& comm) {
  py::module_ MPI = py::module_::import("mpi4py.MPI");
  auto handle = [&](const py::object& c) {
    return PyLong_AsUnsignedLongLongMask(MPI.attr("_handleof")(c).ptr());
  };
  const std::string theirs = py::str(MPI.attr("Get_library_version")()), ours = library_version();
  if (handle(MPI.attr("COMM_WORLD")) != (unsigned long long)(uintptr_t)(MPI_COMM_WORLD) ||
      theirs != ours)
    raise(PLAIT_E_INVALID,
          "mpi4py runs on another MPI library than plait._mpi was built against (mpi4py: " +
              theirs.substr(0, theirs.find('\n')) +
              "; plait._mpi: " + ours.substr(0, ours.find('\n')) +
              "): rebuild plait with that MPI's mpicc on PATH, or use PLAIT_INTER=gloo");
  if (!py::isinstance(comm, MPI.attr("Intracomm")))
    raise(PLAIT_E_INVALID, "make_engine needs an mpi4py intracommunicator, got " +
                               std::string(py::str(py::type::of(comm).attr("__name__"))));
  return from_handle<MPI_Comm>(handle(comm));
}

size_t chunk_from_env() {
  const char* v = std::getenv("PLAIT_MPI_CHUNK_BYTES");
  if (!v || !*v) return 0;
  char* end = nullptr;
  long long n = std::strtoll(v, &end, 10);
  if (*end || n <= 0)
    raise(PLAIT_E_INVALID, std::string("PLAIT_MPI_CHUNK_BYTES=") + v + ": a positive byte count");
  return size_t(n);
}

py::capsule make_engine(const py::object& comm, const std::string& label, size_t chunk_bytes) {
  MPI_Comm c = comm_of(comm);
  if (!chunk_bytes) chunk_bytes = chunk_from_env();
  char err[1024] = "";
  plait_engine* e;
  {
    py::gil_scoped_release nogil;  // collective: the other members may be slower to get here
    e = mpi_engine_create(c, label.c_str(), chunk_bytes, err, sizeof err);
  }
  if (!e) raise(PLAIT_E_INVALID, err);
  return py::capsule(e, PLAIT_ENGINE_CAPSULE);
}

int code_of(const std::string& name, std::initializer_list<const char*> names, const char* what) {
  int i = 0;
  for (const char* n : names) {
    if (name == n) return i;
    ++i;
  }
  raise(PLAIT_E_INVALID, std::string("no such ") + what + ": " + name);
}
uint8_t dtype_code(const py::array& a) {
  return uint8_t(code_of(
      py::str(a.dtype().attr("name")),
      {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"},
      "dtype"));
}
uint8_t op_code(const std::string& op) {
  return uint8_t(code_of(op, {"sum", "prod", "min", "max", "avg"}, "op"));
}

void* data(py::array& a, bool writable, const char* what) {
  if (!(a.flags() & py::array::c_style))
    raise(PLAIT_E_INVALID, std::string(what) + ": not contiguous");
  if (writable && !a.writeable()) raise(PLAIT_E_INVALID, std::string(what) + ": read-only");
  return a.mutable_data();
}

// Calls one engine's functions; owns it (releases it on close() or when collected).
class EngineForTests {
 public:
  explicit EngineForTests(py::capsule c) {
    if (std::string(c.name() ? c.name() : "") != PLAIT_ENGINE_CAPSULE)
      raise(PLAIT_E_INVALID, "not an engine capsule");
    e_ = c.get_pointer<plait_engine>();
    if (!e_ || e_->version != PLAIT_ENGINE_VERSION) raise(PLAIT_E_INVALID, "engine version");
  }
  ~EngineForTests() { close(); }
  void close() {
    if (e_) e_->release(e_->ctx);
    e_ = nullptr;
  }
  const plait_engine& e() const {
    if (!e_) raise(PLAIT_E_INVALID, "the engine was closed");
    return *e_;
  }
  bool supports(const std::string& dtype, const std::string& op) {
    const uint8_t d = uint8_t(code_of(
        dtype,
        {"float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"},
        "dtype"));
    return e().supports(e().ctx, d, op_code(op)) != 0;
  }
  // Runs fn(err, errlen) without the GIL; raises what it returned.
  template <class Fn>
  void call(Fn&& fn) {
    const plait_engine& en = e();
    char err[2048] = "";
    uint32_t k;
    {
      py::gil_scoped_release nogil;
      k = fn(en, err, sizeof err);
    }
    if (k) raise(k, err);
  }
  void allreduce(py::array a, const std::string& op, double t) {
    void* p = data(a, true, "allreduce");
    const uint8_t d = dtype_code(a), o = op_code(op);
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.allreduce(en.ctx, p, size_t(a.size()), d, o, t, err, n);
    });
  }
  void allgather(py::array in, py::array out, double t) {
    const void* i = data(in, false, "allgather in");
    void* o = data(out, true, "allgather out");
    check_blocks(in.nbytes(), out.nbytes(), "allgather");
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.allgather(en.ctx, i, o, size_t(in.nbytes()), t, err, n);
    });
  }
  uintptr_t allreduce_start(py::array a, const std::string& op, double t) {
    void* p = data(a, true, "allreduce");
    const uint8_t d = dtype_code(a), o = op_code(op);
    if (!PLAIT_ENGINE_HAS(&e(), allreduce_start)) raise(PLAIT_E_INVALID, "no allreduce_start");
    void* req = nullptr;
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.allreduce_start(en.ctx, p, size_t(a.size()), d, o, t, &req, err, n);
    });
    return reinterpret_cast<uintptr_t>(req);  // the test keeps a alive until wait
  }
  uintptr_t allgather_start(py::array in, py::array out) {
    const void* i = data(in, false, "allgather in");
    void* o = data(out, true, "allgather out");
    check_blocks(in.nbytes(), out.nbytes(), "allgather");
    void* req = nullptr;
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.allgather_start(en.ctx, i, o, size_t(in.nbytes()), &req, err, n);
    });
    return reinterpret_cast<uintptr_t>(req);  // the test keeps in and out alive until wait
  }
  void wait(uintptr_t req, double t) {
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.wait(en.ctx, reinterpret_cast<void*>(req), t, err, n);
    });
  }
  void broadcast(py::array a, int root, double t) {
    void* p = data(a, true, "broadcast");
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.broadcast(en.ctx, p, size_t(a.nbytes()), root, t, err, n);
    });
  }
  void alltoall(py::array in, py::array out, double t) {
    const void* i = data(in, false, "alltoall in");
    void* o = data(out, true, "alltoall out");
    if (in.nbytes() != out.nbytes() || in.nbytes() % e().size)
      raise(PLAIT_E_INVALID, "alltoall: in and out hold size equal blocks");
    const size_t block = size_t(in.nbytes()) / size_t(e().size);
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.alltoall(en.ctx, i, o, block, t, err, n);
    });
  }
  void send(py::array a, int peer, int tag, double t) {
    const void* p = data(a, false, "send");
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.send(en.ctx, p, size_t(a.nbytes()), peer, tag, t, err, n);
    });
  }
  void recv(py::array a, int peer, int tag, double t) {
    void* p = data(a, true, "recv");
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.recv(en.ctx, p, size_t(a.nbytes()), peer, tag, t, err, n);
    });
  }
  // (src, bytes) of a message of tag ready to receive, (-1, 0) when none; bytes None when the
  // engine cannot tell before receiving it.
  py::tuple probe(int tag) {
    if (!PLAIT_ENGINE_HAS(&e(), probe)) raise(PLAIT_E_INVALID, "this engine has no probe");
    int src = -1;
    size_t bytes = 0;
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.probe(en.ctx, tag, &src, &bytes, err, n);
    });
    if (bytes == PLAIT_ENGINE_UNKNOWN) return py::make_tuple(src, py::none());
    return py::make_tuple(src, bytes);
  }
  // p2p_start's request (the test keeps a alive until p2p_test says done) and p2p_test's done
  uintptr_t p2p_start(bool send, py::array a, int peer, int tag, double t) {
    void* p = data(a, !send, send ? "send" : "recv");
    if (!PLAIT_ENGINE_HAS(&e(), p2p_start)) raise(PLAIT_E_INVALID, "this engine has no p2p_start");
    void* req = nullptr;
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.p2p_start(en.ctx, send, p, size_t(a.nbytes()), peer, tag, t, &req, err, n);
    });
    return reinterpret_cast<uintptr_t>(req);
  }
  bool p2p_test(uintptr_t req) {
    int done = 0;
    call([&](const plait_engine& en, char* err, size_t n) {
      return en.p2p_test(en.ctx, reinterpret_cast<void*>(req), &done, err, n);
    });
    return done != 0;
  }
  void fail(uint32_t kind, const std::string& msg) {
    const plait_engine& en = e();
    py::gil_scoped_release nogil;
    en.fail(en.ctx, kind, msg.c_str());
  }

 private:
  void check_blocks(py::ssize_t in, py::ssize_t out, const char* what) {
    if (out != in * e().size)
      raise(PLAIT_E_INVALID, std::string(what) + ": out must hold size times in's bytes");
  }
  plait_engine* e_ = nullptr;
};

}  // namespace
}  // namespace plait

PYBIND11_MODULE(_mpi, m) {
  using namespace plait;
  m.doc() = "plait's MPI engine between hosts (MPI's C API, driven from an mpi4py communicator)";
  py::module_::import("plait._errors");
  m.def("make_engine", &make_engine, py::arg("comm"), py::arg("label"), py::arg("chunk_bytes") = 0,
        "An engine capsule (PLAIT_ENGINE_CAPSULE) over a duplicate of comm; collective over comm. "
        "Hand it to one owner, which releases it. chunk_bytes (or PLAIT_MPI_CHUNK_BYTES): the "
        "most bytes one MPI call moves (default 1 GiB).");
  m.def("mpi_library", &library_version, "MPI_Get_library_version of the libmpi linked.");
  const double inf = std::numeric_limits<double>::infinity();
  py::class_<EngineForTests>(m, "EngineForTests")
      .def(py::init<py::capsule>())
      .def_property_readonly("rank", [](const EngineForTests& t) { return t.e().rank; })
      .def_property_readonly("size", [](const EngineForTests& t) { return t.e().size; })
      .def_property_readonly("name", [](const EngineForTests& t) { return t.e().name; })
      .def("supports", &EngineForTests::supports)
      .def("allreduce", &EngineForTests::allreduce, py::arg("a"), py::arg("op"),
           py::arg("timeout") = inf)
      .def("allgather", &EngineForTests::allgather, py::arg("a"), py::arg("out"),
           py::arg("timeout") = inf)
      .def("allgather_start", &EngineForTests::allgather_start)
      .def("allreduce_start", &EngineForTests::allreduce_start, py::arg("a"), py::arg("op"),
           py::arg("timeout") = inf)
      .def("wait", &EngineForTests::wait, py::arg("req"), py::arg("timeout") = inf)
      .def("broadcast", &EngineForTests::broadcast, py::arg("a"), py::arg("root"),
           py::arg("timeout") = inf)
      .def("alltoall", &EngineForTests::alltoall, py::arg("a"), py::arg("out"),
           py::arg("timeout") = inf)
      .def("send", &EngineForTests::send, py::arg("a"), py::arg("peer"), py::arg("tag"),
           py::arg("timeout") = inf)
      .def("recv", &EngineForTests::recv, py::arg("a"), py::arg("peer"), py::arg("tag"),
           py::arg("timeout") = inf)
      .def("probe", &EngineForTests::probe, py::arg("tag"))
      .def("p2p_start", &EngineForTests::p2p_start, py::arg("send"), py::arg("a"), py::arg("peer"),
           py::arg("tag"), py::arg("timeout") = inf)
      .def("p2p_test", &EngineForTests::p2p_test, py::arg("req"))
      .def("fail", &EngineForTests::fail)
      .def("close", &EngineForTests::close);
}
