// plait.horovod's cached fast path: one coordinator cycle of a repeated allreduce in one C++ call.
//
// In a training loop every rank submits the same cached request each step, so the cycle's
// exchange brings nothing new: every rank's frame is the same slot number, the ready list is that
// one name, its check passed before and its plan (which buffer, which plait op, which scale
// factors) is the same as last time. python/plait/horovod/common/_fastpath.py keeps that plan
// (an _HvdPlan) per cached name and, when a cycle has exactly such a request to send, hands it to
// _HvdCycle.run, which does here, with the GIL released:
//   1. the cycle's exchange: this rank's frame (-2: one cached slot, then the slot) in the same
//      plait allgather of fixed frames the Python cycle makes (peers may be running either);
//   2. if any rank's frame differs from this one (another request, an idle cycle, a join, a
//      stop): returns -1, leaving every rank's frame in the controller's buffer, and Python goes
//      on with the cycle from its exchange (nothing else was done);
//   3. otherwise the plan: a group layout's gather into its span of the shared-memory fusion buffer
//      (times the prescale factor), plait's allreduce in place there, the scatter back (times the
//      postscale factor; autograd versions bumped); or one tensor reduced in place where it is.
// Steps 1 and 3 are plait calls through the C API (bindings/capi.h): 0 when they ran, else the
// plait error kind, its message in .error. Costs: one 1 KiB-per-rank allgather plus the plan's
// copies and allreduce, and one crossing from Python, against about 190 Python calls per cycle.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/python.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "bindings/capi.h"
#include "torch/backend.h"
#include "torch/horovod.h"

namespace plait_torch {
namespace {

namespace py = pybind11;

const plait_capi* capi_of(const py::capsule& api) {
  auto* table = static_cast<const plait_capi*>(api.get_pointer());
  if (std::string(api.name()) != PLAIT_CAPI_CAPSULE || table->version != PLAIT_CAPI_VERSION)
    throw std::runtime_error("plait._C's C API does not match this build of the torch backend");
  return table;
}

void* comm_of(const py::capsule& comm) {
  if (std::string(comm.name()) != PLAIT_COMM_CAPSULE)
    throw py::value_error("not a plait communicator");
  return comm.get_pointer();
}

// A contiguous CPU buffer of n bytes that plait reads and writes.
plait_buffer host(void* p, size_t n, int dtype) {
  plait_buffer b{};
  b.ptr = p, b.bytes = n, b.dtype = uint8_t(dtype), b.present = 1, b.writable = 1;
  return b;
}

// The steps of one cached allreduce (the Python executor's for the same request, on this rank).
class Plan {
 public:
  // group: a layout's tensors (their span of the fusion buffer given), or None: one tensor,
  // passed to each run, reduced in place. op: capi.h's plait_op.
  Plan(py::capsule comm, py::object owner, int op, double pre, double post, py::object group,
       py::object span)
      : comm_(comm_of(comm)), owner_(std::move(owner)), op_(op), pre_(pre), post_(post) {
    if (op < PLAIT_SUM || op > PLAIT_AVG) throw py::value_error("unknown plait op");
    if (!group.is_none()) {
      group_ = group.cast<std::shared_ptr<Group>>();
      span_ = span.cast<at::Tensor>();
      if (!span_.device().is_cpu() || !span_.is_contiguous() || dtype_code(span_.scalar_type()) < 0)
        throw py::value_error("plait.horovod fast path: the span must be a contiguous CPU tensor");
    }
  }

  // Runs the plan on this rank (tensor: the one tensor when the plan has no group). 0, or the
  // kind of the plait error (its text in err).
  uint32_t run(const plait_capi* api, at::Tensor t, char* err, size_t errlen) const {
    at::Tensor buf = group_ ? span_ : t;
    const int dt = dtype_code(buf.scalar_type());
    if (group_) {
      group_->gather_into(buf, pre_);
    } else if (pre_ != 1.0) {
      scale_in_place(buf, pre_);
    }
    // Called even with no elements, as the Python executor calls it: the ranks' plait calls
    // stay the same whichever path each took.
    plait_buffer b = host(buf.data_ptr(), buf.nbytes(), dt);
    const uint32_t kind = api->call(comm_, PLAIT_ALLREDUCE, &b, &b, uint8_t(op_), 0, -1, 0, "auto",
                                    -1.0, nullptr, nullptr, nullptr, err, errlen);
    if (kind) return kind;
    if (group_) {
      group_->scatter_from(buf, post_);
    } else if (post_ != 1.0) {
      scale_in_place(buf, post_);
    }
    return PLAIT_OK;
  }

  bool grouped() const { return bool(group_); }

 private:
  void* comm_;
  py::object owner_;  // the Python communicator: keeps comm_ alive
  int op_;
  double pre_, post_;
  std::shared_ptr<Group> group_;
  at::Tensor span_;
};

// The controller's exchange buffers and world communicator.
class Cycle {
 public:
  Cycle(py::capsule api, py::capsule comm, py::object owner, py::buffer frame, py::buffer frames)
      : api_(capi_of(api)),
        comm_(comm_of(comm)),
        owner_(std::move(owner)),
        frame_(frame),
        frames_(frames) {
    py::buffer_info f = frame_.request(true), fs = frames_.request(true);
    if (f.itemsize != 1 || fs.itemsize != 1 || f.size < 16 || fs.size % f.size)
      throw py::value_error("plait.horovod fast path: frames must be bytes, frames a multiple");
    send_ = static_cast<char*>(f.ptr), recv_ = static_cast<char*>(fs.ptr);
    bytes_ = size_t(f.size), ranks_ = size_t(fs.size / f.size);
  }

  // One cycle of cached request `slot` with plan (tensor: the plan's one tensor, else None).
  // 0: ran; -1: the frames differ (they are in the controller's buffer); else a plait error kind.
  int run(int slot, const Plan& plan, py::object tensor) {
    at::Tensor t;
    if (!plan.grouped()) {
      t = tensor.cast<at::Tensor>();
      if (!t.device().is_cpu() || !t.is_contiguous() || dtype_code(t.scalar_type()) < 0)
        throw py::value_error("plait.horovod fast path: the tensor must be contiguous, on the CPU");
    }
    const int64_t head = -2;  // the Python cycle's frame of one cached slot
    const int32_t s = slot;
    std::memcpy(send_, &head, sizeof head);
    std::memcpy(send_ + sizeof head, &s, sizeof s);
    constexpr size_t kHead = sizeof head + sizeof s;
    char msg[8192];  // written (NUL-terminated) only when a call fails
    msg[0] = '\0';
    uint32_t kind;
    {
      py::gil_scoped_release nogil;
      plait_buffer in = host(send_, bytes_, PLAIT_U8), out = host(recv_, bytes_ * ranks_, PLAIT_U8);
      kind = api_->call(comm_, PLAIT_ALLGATHER, &in, &out, PLAIT_SUM, 0, -1, 0, "auto", -1.0,
                        nullptr, nullptr, nullptr, msg, sizeof msg);
      if (!kind) {
        for (size_t r = 0; r < ranks_; ++r)
          if (std::memcmp(recv_ + r * bytes_, send_, kHead) != 0) return -1;
        kind = plan.run(api_, t, msg, sizeof msg);
      }
    }
    error_ = kind ? std::string(msg) : std::string();
    return int(kind);
  }

  const std::string& error() const { return error_; }

 private:
  const plait_capi* api_;
  void* comm_;
  py::object owner_;
  py::buffer frame_, frames_;  // kept: their memory is written here
  char *send_ = nullptr, *recv_ = nullptr;
  size_t bytes_ = 0, ranks_ = 0;
  std::string error_;
};

}  // namespace

void bind_horovod_fast(py::module_& m) {
  py::class_<Plan>(m, "_HvdPlan", "the steps of one cached plait.horovod allreduce on this rank")
      .def(py::init<py::capsule, py::object, int, double, double, py::object, py::object>(),
           py::arg("comm"), py::arg("owner"), py::arg("op"), py::arg("pre"), py::arg("post"),
           py::arg("group"), py::arg("span"));
  py::class_<Cycle>(m, "_HvdCycle", "plait.horovod's exchange and cached plans, one call a cycle")
      .def(py::init<py::capsule, py::capsule, py::object, py::buffer, py::buffer>(), py::arg("api"),
           py::arg("comm"), py::arg("owner"), py::arg("frame"), py::arg("frames"))
      .def("run", &Cycle::run, py::arg("slot"), py::arg("plan"), py::arg("tensor"),
           "0: ran; -1: the ranks' frames differ (the exchange is in frames); else an error kind")
      .def_property_readonly("error", &Cycle::error);
}

}  // namespace plait_torch
