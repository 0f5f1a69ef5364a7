// plait._C: the private compiled module. The public names live in python/plait/__init__.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/errors.h"
#include "reduce/reduce.h"
#include "transport/shared_mem.h"
#include "transport/table.h"

namespace py = pybind11;

namespace plait {
void bind_comm(py::module_& m);
void bind_gpu(py::module_& m);
void bind_capi(py::module_& m);
void bind_tables(py::module_& m);
void bind_hier(py::module_& m);
void bind_py_engine(py::module_& m);

namespace {
// Memory of one plait.empty() array: a writable buffer that frees its region when the last
// array viewing it goes away (numpy keeps this object as the array's base).
struct SharedBuffer {
  explicit SharedBuffer(size_t n) : bytes(n) { ptr = static_cast<char*>(shared_alloc(n, &id)); }
  ~SharedBuffer() { shared_free(id); }
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;
  char* ptr = nullptr;
  size_t bytes;
  uint64_t id = 0;
};
}  // namespace

void bind_shared(py::module_& m) {
  py::class_<SharedBuffer>(m, "SharedBuffer", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.ptr, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {py::ssize_t(b.bytes)}, {py::ssize_t(1)}, /*readonly=*/false);
      })
      .def_readonly("nbytes", &SharedBuffer::bytes);
  m.def("shared_region_count", &shared_region_count, "Live plait shared buffers in this process.");
  m.def(
      "is_shared",
      [](uintptr_t addr, size_t bytes) {
        RegionRef r;
        return shared_find(reinterpret_cast<const void*>(addr), std::max<size_t>(bytes, 1), &r);
      },
      py::arg("addr"), py::arg("nbytes"));
}
}  // namespace plait

PYBIND11_MODULE(_C, m) {
  using namespace plait;
  m.doc() = "plait native core (shared-memory collectives)";
  // C++ error kinds map one-to-one onto the classes of plait._errors.
  py::module_::import("plait._errors");  // fail at import, not at the first error, if missing
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PlaitError& e) {
      const char* cls = "PlaitError";
      switch (e.kind()) {
        case ErrorKind::invalid:
          cls = "InvalidArgument";
          break;
        case ErrorKind::mismatch:
          cls = "MismatchError";
          break;
        case ErrorKind::timeout:
          cls = "TimeoutError";
          break;
        case ErrorKind::peer_lost:
          cls = "PeerLostError";
          break;
        default:
          break;
      }
      py::object type = py::module_::import("plait._errors").attr(cls);
      if (!e.flight) {
        PyErr_SetString(type.ptr(), e.what());
        return;
      }
      // The flight recorder's report rides along as e.flight (a dict); see core/flight.h.
      try {
        py::object exc = type(e.what());
        exc.attr("flight") = py::module_::import("json").attr("loads")(*e.flight);
        PyErr_SetObject(type.ptr(), exc.ptr());
      } catch (py::error_already_set&) {
        PyErr_SetString(type.ptr(), e.what());
      }
    }
  });
  m.def("build_info", [] {
    py::dict d;
    // cuda: compiled with the CUDA path (whether a device is present is cuda_devices).
    d["cuda"] = bool(PLAIT_WITH_CUDA);
    std::vector<std::string> transports;
    for (const TransportKind& t : transport_table())
      if (t.built) transports.push_back(t.name);
    d["transports"] = transports;
    d["reduce_isa"] = reduce_isa();
    return d;
  });
  bind_shared(m);
  bind_comm(m);
  bind_gpu(m);
  bind_capi(m);
  bind_tables(m);
  bind_hier(m);
  bind_py_engine(m);
}
