// plait.horovod's grouped allreduce, the per-tensor part (python/plait/horovod/common/_fusion.py).
//
// A group of many small tensors (DistributedOptimizer's gradients, a grouped_allreduce_ of a
// fixed list) is reduced as one span of the fusion buffer. In Python, the per-tensor work around
// that one reduction (a layout check of every tensor, the copy in, the copy out, the autograd
// version bump) cost about three times the reduction of 100 x 1 KiB itself, one dispatch per
// tensor each. Here each step is one call over the whole list:
//   _hvd_meta(tensors)  -> bytes: every tensor's address, dtype, device, shape and contiguity;
//                          equal bytes mean the cached layout (request, shapes text) still holds
//   _hvd_same(tensors, meta) -> whether _hvd_meta(tensors) == meta, read in place (each step)
//   _HvdGroup(tensors)  one dtype's tensors of a layout, kept with it; then, every step:
//     .gather(out, f)   copies the tensors' elements, in order, into out, times f
//     .scatter(src, f)  copies src back into the tensors, times f, and bumps each tensor's
//                       autograd version (an in-place write, as copy_ would be)
// Each step checks what it touches (CPU, contiguous, one dtype, element counts adding up to
// the span) and raises ValueError naming the tensor, so a tensor changed since its layout was
// cached can never make it write out of bounds. Scaling follows Horovod's ScaleBuffer: floating
// types multiply in their own precision (float32/float64 inside the copy loop), integers multiply
// in double precision and truncate.
#include "torch/horovod.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/python.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace plait_torch {
namespace {

namespace py = pybind11;

constexpr size_t kReleaseGilBytes = 256 << 10;  // below this a copy is shorter than a GIL handoff

std::string where(const char* call, size_t i, const at::Tensor& t) {
  return std::string("plait.horovod ") + call + ": tensor " + std::to_string(i) +
         " of the group (" + std::string(c10::toString(t.scalar_type())) + ", " +
         std::to_string(t.numel()) + " elements, " + t.device().str() + ")";
}

// Checks the group against the span and returns the byte offset of each tensor in it.
std::vector<size_t> offsets(const char* call, const std::vector<at::Tensor>& ts,
                            const at::Tensor& span) {
  if (!span.device().is_cpu() || !span.is_contiguous())
    throw py::value_error(std::string("plait.horovod ") + call +
                          ": the fusion span must be a contiguous CPU tensor");
  std::vector<size_t> at_byte(ts.size());
  size_t bytes = 0, item = span.element_size();
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    if (!t.device().is_cpu() || !t.is_contiguous() || t.scalar_type() != span.scalar_type())
      throw py::value_error(where(call, i, t) + ": expected a contiguous CPU tensor of " +
                            std::string(c10::toString(span.scalar_type())));
    at_byte[i] = bytes;
    bytes += static_cast<size_t>(t.numel()) * item;
  }
  if (bytes != static_cast<size_t>(span.numel()) * item)
    throw py::value_error(std::string("plait.horovod ") + call + ": the group's " +
                          std::to_string(ts.size()) + " tensors hold " + std::to_string(bytes) +
                          " bytes, the fusion span " + std::to_string(span.numel() * item));
  return at_byte;
}

template <class T>
void copy_scaled(T* dst, const T* src, int64_t n, double f) {
  const T s = static_cast<T>(f);
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i] * s;
}

// dst = src * f over n elements of type st (dst and src do not overlap).
void copy_one(char* dst, const char* src, int64_t n, at::ScalarType st, double f) {
  if (f == 1.0 || n == 0) {
    std::memcpy(dst, src, static_cast<size_t>(n) * c10::elementSize(st));
  } else if (st == at::kFloat) {
    copy_scaled(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(src), n, f);
  } else {
    copy_scaled(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(src), n, f);
  }
}

// Horovod's ScaleBuffer for the dtypes the copy loop does not scale, in place.
}  // namespace

void scale_in_place(at::Tensor& t, double f) {
  if (f == 1.0 || t.numel() == 0) return;
  if (at::isFloatingType(t.scalar_type())) {
    t.mul_(f);
  } else {
    t.copy_(t.to(at::kDouble).mul_(f).trunc_());
  }
}

namespace {

bool fused_scale(at::ScalarType st) { return st == at::kFloat || st == at::kDouble; }

// One tensor's entry in a layout's meta: address, dtype/device/contiguity, rank, sizes.
void pack(const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
  out.push_back(static_cast<int64_t>(t.scalar_type()) |
                (static_cast<int64_t>(t.device().type()) << 8) |
                (static_cast<int64_t>(t.device().index() + 1) << 16) |
                (static_cast<int64_t>(t.is_contiguous()) << 32));
  out.push_back(t.dim());
  for (int64_t s : t.sizes()) out.push_back(s);
}

py::bytes meta(const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> out;
  out.reserve(ts.size() * 5);
  for (const at::Tensor& t : ts) pack(t, out);
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

// Whether meta(tensors) would equal want, without building it: a cached group's check each step
// (the tensors are read in place from the Python sequence: no list conversion, no refcounts).
bool same_meta(py::handle tensors, const py::bytes& want) {
  PyObject* seq = PySequence_Fast(tensors.ptr(), "plait.horovod: a group is a sequence of tensors");
  if (!seq) throw py::error_already_set();
  py::object keep = py::reinterpret_steal<py::object>(seq);
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_AsStringAndSize(want.ptr(), &data, &len) != 0) throw py::error_already_set();
  const size_t words = size_t(len) / sizeof(int64_t);
  std::vector<int64_t> one;
  size_t at_word = 0;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!THPVariable_Check(items[i])) return false;
    one.clear();
    pack(THPVariable_Unpack(items[i]), one);
    if (at_word + one.size() > words ||
        std::memcmp(data + at_word * sizeof(int64_t), one.data(), one.size() * sizeof(int64_t)))
      return false;
    at_word += one.size();
  }
  return at_word == words;
}

}  // namespace

Group::Group(const std::vector<at::Tensor>& ts) {
  // Detached here (sharing storage and version counter) rather than by a Python call per tensor.
  // They must not be the caller's own tensors: holding those from C++ would keep their Python
  // objects alive, and the layout is dropped when one of those objects is freed.
  ts_.reserve(ts.size());
  for (const at::Tensor& t : ts) ts_.push_back(t.detach());
}

void Group::gather_into(const at::Tensor& out, double f) const {
  std::vector<size_t> at_byte = offsets("gather", ts_, out);
  const at::ScalarType st = out.scalar_type();
  const bool fuse = fused_scale(st);
  char* base = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < ts_.size(); ++i)
    copy_one(base + at_byte[i], static_cast<const char*>(ts_[i].data_ptr()), ts_[i].numel(), st,
             fuse ? f : 1.0);
  if (!fuse) {
    at::Tensor o = out;
    scale_in_place(o, f);
  }
}

void Group::scatter_from(const at::Tensor& src, double f) const {
  std::vector<size_t> at_byte = offsets("scatter", ts_, src);
  const at::ScalarType st = src.scalar_type();
  const bool fuse = fused_scale(st);
  if (!fuse) {
    at::Tensor s = src;
    scale_in_place(s, f);
  }
  const char* base = static_cast<const char*>(src.data_ptr());
  for (size_t i = 0; i < ts_.size(); ++i)
    copy_one(static_cast<char*>(ts_[i].data_ptr()), base + at_byte[i], ts_[i].numel(), st,
             fuse ? f : 1.0);
  // An in-place write, as far as autograd is concerned: a tensor saved for backward before
  // is reported modified (views share their base's counter, as in torch's own in-place ops).
  for (const at::Tensor& t : ts_) torch::autograd::impl::bump_version(t);
}

void Group::gather(const at::Tensor& out, double f) const {
  std::unique_ptr<py::gil_scoped_release> nogil;
  if (out.nbytes() >= kReleaseGilBytes) nogil = std::make_unique<py::gil_scoped_release>();
  gather_into(out, f);
}

void Group::scatter(const at::Tensor& src, double f) const {
  std::unique_ptr<py::gil_scoped_release> nogil;
  if (src.nbytes() >= kReleaseGilBytes) nogil = std::make_unique<py::gil_scoped_release>();
  scatter_from(src, f);
}

void bind_horovod(py::module_& m) {
  m.def("_hvd_meta", &meta, "every tensor's address, dtype, device and shape, as bytes");
  m.def("_hvd_same", &same_meta, "whether _hvd_meta(tensors) == want (without building it)");
  py::class_<Group, std::shared_ptr<Group>>(m, "_HvdGroup",
                                            "one dtype's tensors of a plait.horovod group layout")
      .def(py::init<const std::vector<at::Tensor>&>())
      .def("gather", &Group::gather, "the tensors' elements, in order, into out, times f")
      .def("scatter", &Group::scatter, "src back into the tensors, times f; bumps their versions");
  bind_horovod_fast(m);
}

}  // namespace plait_torch
