// The algorithm and transport tables as Python sees them: plait.algorithms() and the GPU
// transport choice read them, and tests check their rows.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algo/algo.h"
#include "core/errors.h"
#include "transport/table.h"

namespace py = pybind11;

namespace plait {

namespace {
std::vector<std::string> cap_names(Caps caps) {
  std::vector<std::string> names;
  for (int i = 0; i < kCapCount; ++i)
    if (caps & (Caps(1) << i)) names.push_back(kCapNames[i]);
  return names;
}

Caps caps_named(const std::vector<std::string>& names) {
  Caps caps = 0;
  for (const std::string& n : names) {
    int i = 0;
    while (i < kCapCount && n != kCapNames[i]) ++i;
    if (i == kCapCount) {
      std::string all;
      for (const char* k : kCapNames) all += (all.empty() ? "" : ", ") + std::string(k);
      throw InvalidArgument("unknown capability '" + n + "' (" + all + ")");
    }
    caps |= Caps(1) << i;
  }
  return caps;
}

std::vector<std::string> names_of(Coll c, Caps caps) {
  std::vector<std::string> names;
  for (const Algorithm* a : algorithms_for(c, caps)) names.push_back(a->name);
  return names;
}
}  // namespace

void bind_tables(py::module_& m) {
  m.def(
      "algorithms",
      [](const std::string& coll, const std::string& transport) {
        return names_of(coll_named(coll), transport_caps(transport));
      },
      py::arg("collective"), py::arg("transport") = "shm",
      "Algorithm names of a collective that a transport is offered, in table order.");
  m.def(
      "algorithms_with",
      [](const std::string& coll, const std::vector<std::string>& caps) {
        return names_of(coll_named(coll), caps_named(caps));
      },
      py::arg("collective"), py::arg("caps"),
      "Algorithm names of a collective whose needs these capabilities cover, in table order.");
  m.def(
      "algorithm_rows",
      [] {
        static const char* kinds[] = {"host", "gpu", "ipc"};
        py::list rows;
        for (const Algorithm& a : algorithm_table())
          rows.append(
              py::make_tuple(coll_name(a.coll), a.name, cap_names(a.needs), kinds[a.run.kind]));
        return rows;
      },
      "The one algorithm table: (collective, name, capabilities needed, runs on host/gpu/ipc).");
  m.def(
      "auto_algorithm",
      [](const std::string& coll, size_t bytes, int world, size_t staging_bytes,
         const std::vector<std::string>& caps, bool oversubscribed) {
        return std::string(auto_algorithm(
            coll_named(coll), {caps_named(caps), bytes, world, staging_bytes, oversubscribed}));
      },
      py::arg("collective"), py::arg("bytes"), py::arg("world"), py::arg("staging_bytes"),
      py::arg("caps"), py::arg("oversubscribed") = false,
      "The algorithm name auto picks for a call of this shape on a transport with these caps.");
  m.def(
      "transports",
      [] {
        py::list out;
        for (const TransportKind& t : transport_table())
          out.append(py::make_tuple(t.name, cap_names(t.caps), t.built));
        return out;
      },
      "The ordered transport table: (name, capabilities, compiled into this build).");
  m.def(
      "select_transport",
      [](bool device_buffers, bool one_host, bool shared_gpu, bool nccl_loaded,
         const std::string& prefer) -> py::object {
        TransportProbe p;
        p.device_buffers = device_buffers;
        p.one_host = one_host;
        p.shared_gpu = shared_gpu;
        p.nccl_loaded = nccl_loaded;
        p.prefer = prefer;
        const TransportKind* t = select_transport(p);
        return t ? py::object(py::str(t->name)) : py::object(py::none());
      },
      py::arg("device_buffers"), py::arg("one_host") = true, py::arg("shared_gpu") = false,
      py::arg("nccl_loaded") = true, py::arg("prefer") = "auto",
      "The first transport of the table that can connect a call's ranks with such buffers, or "
      "None.");
}

}  // namespace plait
