// _C.HierComm: the multi-host communicator (hier/hier_comm.h) as a _C._Comm, so
// plait._comm.Communicator's methods, fast_call and the C API drive it as they drive a flat one.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "hier/hier_comm.h"

namespace py = pybind11;

namespace plait {
namespace {
// The plait_engine a capsule holds; each capsule is handed to one communicator only.
plait_engine* take_engine(const py::object& o, const char* what) {
  if (o.is_none()) return nullptr;
  PyObject* cap = o.ptr();
  if (!PyCapsule_IsValid(cap, PLAIT_ENGINE_CAPSULE))
    throw InvalidArgument(std::string(what) + " must be a '" PLAIT_ENGINE_CAPSULE
                                              "' capsule or None");
  if (PyCapsule_GetContext(cap))
    throw InvalidArgument(std::string(what) +
                          ": this engine capsule already belongs to a communicator");
  auto* e = static_cast<plait_engine*>(PyCapsule_GetPointer(cap, PLAIT_ENGINE_CAPSULE));
  PyCapsule_SetContext(cap, e);  // marks it taken
  return e;
}
}  // namespace

void bind_hier(py::module_& m) {
  m.attr("HIER_FRAME") = kFrame;
  m.attr("HIER_ROOM") = kRoom;
  py::class_<HierComm, Comm, std::shared_ptr<HierComm>>(m, "HierComm")
      .def(py::init([](std::shared_ptr<Communicator> local, int rank, int size,
                       std::vector<int64_t> hosts, py::object inter, py::object world,
                       double timeout, const std::string& label) {
             plait_engine* w = take_engine(world, "world");
             plait_engine* i = take_engine(inter, "inter");
             // Dropped with the GIL held (the last Python reference), it must not hold it
             // while the local progress thread finishes a call that needs it.
             return std::shared_ptr<HierComm>(
                 new HierComm(std::move(local), rank, size, hosts, i, w, timeout, label),
                 [](HierComm* c) {
                   if (Py_IsInitialized() && PyGILState_Check()) {
                     py::gil_scoped_release nogil;
                     delete c;
                   } else {
                     delete c;
                   }
                 });
           }),
           py::arg("local"), py::arg("rank"), py::arg("size"), py::arg("hosts"), py::arg("inter"),
           py::arg("world"), py::arg("timeout"), py::arg("label") = "")
      .def_property_readonly("engine", &HierComm::engine)
      .def_property_readonly("hosts", [](const HierComm& c) { return c.layout().hosts; })
      .def_property_readonly("uniform", [](const HierComm& c) { return c.layout().uniform; })
      // tests: the cross-host frame's room now (hier_comm.h), read between calls
      .def_property_readonly("_frame_room", &HierComm::frame_room);
}

}  // namespace plait
