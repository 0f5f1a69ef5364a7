// plait._C: the private compiled module. The public names live in python/plait/__init__.py.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algo/algo.h"
#include "core/errors.h"
#include "reduce/reduce.h"

namespace py = pybind11;

namespace plait {
void bind_comm(py::module_& m);
void bind_gpu(py::module_& m);
}

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
        case ErrorKind::invalid: cls = "InvalidArgument"; break;
        case ErrorKind::mismatch: cls = "MismatchError"; break;
        case ErrorKind::timeout: cls = "TimeoutError"; break;
        case ErrorKind::peer_lost: cls = "PeerLostError"; break;
        default: break;
      }
      py::object errors = py::module_::import("plait._errors");
      PyErr_SetString(errors.attr(cls).ptr(), e.what());
    }
  });
  m.def("algorithms", [](const std::string& coll) {
    for (int c = 0; c < int(Coll::kCount); ++c) {
      if (coll != coll_name(Coll(c))) continue;
      std::vector<std::string> names;
      for (auto* a : algorithms_for(Coll(c))) names.push_back(a->name);
      return names;
    }
    throw InvalidArgument("unknown collective '" + coll + "'");
  }, py::arg("collective"), "Algorithm names of a collective, in table order.");
  m.def("build_info", [] {
    py::dict d;
    // cuda: compiled with the CUDA path (whether a device is present is cuda_devices).
    d["cuda"] = bool(PLAIT_WITH_CUDA);
    d["transports"] = PLAIT_WITH_CUDA ? std::vector<std::string>{"shm", "nccl"} : std::vector<std::string>{"shm"};
    d["reduce_isa"] = reduce_isa();
    return d;
  });
  bind_comm(m);
  bind_gpu(m);
}
