// Bindings for segments, communicators and async handles. Arrays cross as numpy arrays (the
// facade turns torch tensors into numpy views first); the GIL is released while C++ works.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/communicator.h"
#include "reduce/reduce.h"

namespace py = pybind11;

namespace plait {
namespace {

DType parse_dtype(const std::string& s) {
  for (int t = 0; t < int(DType::kCount); ++t)
    if (s == dtype_name(DType(t))) return DType(t);
  throw InvalidArgument("unsupported dtype '" + s + "'");
}

RedOp parse_op(const std::string& s) {
  for (int o = 0; o < int(RedOp::kCount); ++o)
    if (s == op_name(RedOp(o))) return RedOp(o);
  throw InvalidArgument("unknown op '" + s + "' (sum, prod, min, max, avg)");
}

// Element type from numpy's dtype: kind and size, or the name for ml_dtypes' bfloat16.
bool infer_dtype(const py::array& a, DType* out) {
  const py::dtype dt = a.dtype();
  // numpy writes native order as '=' (or '|' for single bytes); anything explicit is foreign.
  const char order = dt.byteorder();
  if (order == (__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__ ? '>' : '<')) return false;
  const char kind = dt.kind();
  const auto size = dt.itemsize();
  switch (kind) {
    case 'f':
      *out = size == 2 ? DType::f16 : size == 4 ? DType::f32 : DType::f64;
      return size == 2 || size == 4 || size == 8;
    case 'i':
      *out = size == 1 ? DType::i8 : size == 4 ? DType::i32 : DType::i64;
      return size == 1 || size == 4 || size == 8;
    case 'u':
      *out = DType::u8;
      return size == 1;
    case 'b':
      *out = DType::boolean;
      return size == 1;
    default:
      if (size == 2 && py::str(dt.attr("name")).cast<std::string>() == "bfloat16") {
        *out = DType::bf16;
        return true;
      }
      return false;
  }
}

// Releases the GIL at construction (now) or at the first long wait, and takes it back when the
// call is over, exceptions included (pybind11 translates them with the GIL held).
class LazyGilRelease final : public LongWaitHook {
 public:
  explicit LazyGilRelease(bool now) {
    if (now) on_long_wait();
  }
  ~LazyGilRelease() {
    if (saved_) PyEval_RestoreThread(saved_);
  }
  void on_long_wait() override {
    if (!saved_) saved_ = PyEval_SaveThread();
  }

 private:
  PyThreadState* saved_ = nullptr;
};

struct Call {
  std::string err;
  Buffer to_buffer(const py::object& o, const char* name, const std::string& dtype) {
    Buffer b;
    if (o.is_none()) return b;
    if (!py::isinstance<py::array>(o)) {
      err = std::string(name) + " must be a numpy array or a torch CPU tensor, got " +
            py::str(py::type::of(o).attr("__name__")).cast<std::string>();
      return b;
    }
    auto a = py::reinterpret_borrow<py::array>(o);
    b.present = true;
    b.ptr = const_cast<void*>(a.data());
    b.bytes = size_t(a.nbytes());
    b.writable = a.writeable();
    b.contiguous = (a.flags() & py::array::c_style) != 0;
    if (!dtype.empty()) {
      b.dtype = parse_dtype(dtype);
      if (size_t(a.itemsize()) != dtype_size(b.dtype))
        err = std::string(name) + " has " + std::to_string(a.itemsize()) +
              "-byte elements, dtype='" + dtype + "' needs " + std::to_string(dtype_size(b.dtype));
    } else if (!infer_dtype(a, &b.dtype)) {
      err = std::string(name) + " has unsupported dtype " + py::str(a.dtype()).cast<std::string>() +
            " (float16, bfloat16, float32, float64, int8, uint8, int32, int64, bool; native byte "
            "order)";
    }
    return b;
  }
};

py::object call_buffers(Comm& c, Coll coll, const Buffer& in, const Buffer& o, Call& k,
                        const std::string& op, int root, int peer, int64_t tag,
                        const std::string& algo, std::optional<double> timeout, bool async) {
  RedOp rop = RedOp::sum;
  if (k.err.empty()) {
    try {
      rop = parse_op(op);
    } catch (const InvalidArgument& e) {
      k.err = e.what();
    }
  }
  if (!k.err.empty())
    c.fail(ErrorKind::invalid,
           "rank " + std::to_string(c.rank()) + ": " + coll_name(coll) + ": " + k.err);
  std::shared_ptr<Task> t;
  {
    // Small synchronous calls keep the GIL unless they have to wait (see LongWaitHook); large
    // ones copy and reduce for long enough that other Python threads must be let in at once.
    constexpr size_t kKeepGilBytes = 64 * 1024;
    LazyGilRelease gil(!async && in.bytes + o.bytes > kKeepGilBytes);
    LongWaitScope scope(&gil);
    t = c.call(coll, in, o, rop, root, peer, tag, algo, timeout, async);
  }
  if (t) return py::cast(t);
  return py::none();
}

py::object call(Comm& c, Coll coll, const py::object& x, const py::object& out,
                const std::string& op, int root, int peer, int64_t tag, const std::string& algo,
                std::optional<double> timeout, bool async, const std::string& dtype) {
  Call k;
  Buffer in = k.to_buffer(x, "input", dtype);
  Buffer o = k.to_buffer(out, "output", dtype);
  return call_buffers(c, coll, in, o, k, op, root, peer, tag, algo, timeout, async);
}

// Runs fn, turning a C++ exception into the Python one pybind11's translators (plait's error
// classes) make; returns nullptr with the Python error set, as a METH_FASTCALL function must.
template <class F>
PyObject* translate(F&& fn) {
  try {
    fn();
    Py_RETURN_NONE;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const std::exception& e) {
    try {
      throw;
    } catch (...) {
      py::detail::try_translate_exceptions();
    }
  }
  return nullptr;
}

std::string utf8(PyObject* o, const char* what) {
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(o, &n);
  if (!p) throw InvalidArgument(std::string(what) + " must be a string");
  return std::string(p, size_t(n));
}

Coll coll_arg(PyObject* o) {
  const long coll = PyLong_AsLong(o);
  if (coll < 0 || coll >= long(Coll::kCount)) throw InvalidArgument("bad collective code");
  return Coll(coll);
}

int root_arg(PyObject* o) {
  const long root = PyLong_AsLong(o);
  if (root == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (root < INT32_MIN || root > INT32_MAX) throw InvalidArgument("root is out of range");
  return int(root);
}

// A contiguous host buffer given as (address, bytes): a torch CPU tensor's memory, which
// plait._arrays vouches for (the caller holds the tensor for the call).
Buffer host_buffer(PyObject* ptr, PyObject* bytes, DType dtype) {
  Buffer b;
  b.ptr = PyLong_AsVoidPtr(ptr);
  b.bytes = PyLong_AsSize_t(bytes);
  if (PyErr_Occurred()) throw py::error_already_set();
  b.dtype = dtype;
  b.present = true;
  return b;
}

// fast_host(comm, coll, x_ptr, x_bytes, out_ptr, out_bytes, dtype, op, algorithm, root): the
// small-message path of torch CPU tensors, which skips building numpy views of them (~3 us of
// a call; see python/plait/_comm.py).
PyObject* fast_host(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return translate([&] {
    if (nargs != 10)
      throw InvalidArgument(
          "fast_host takes (comm, coll, x_ptr, x_bytes, out_ptr, out_bytes, dtype, op, algorithm, "
          "root)");
    Comm& c = py::handle(args[0]).cast<Comm&>();
    const Coll coll = coll_arg(args[1]);
    const DType dt = parse_dtype(utf8(args[6], "dtype"));
    const Buffer in = host_buffer(args[2], args[3], dt), o = host_buffer(args[4], args[5], dt);
    Call k;
    call_buffers(c, coll, in, o, k, utf8(args[7], "op"), root_arg(args[9]), -1, 0,
                 utf8(args[8], "algorithm"), std::nullopt, false);
  });
}

PyMethodDef fast_host_def = {
    "fast_host", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_host)),
    METH_FASTCALL,
    "fast_host(comm, coll, x_ptr, x_bytes, out_ptr, out_bytes, dtype, op, algorithm, root)"};

// The small-message entry point, called as fast_call(comm, coll, x, out, op, algorithm[, root])
// with positional arguments only: METH_FASTCALL without pybind11's overload dispatch, which
// measured ~0.2 us of a 0.4 us call. Everything else (validation, errors) is shared with call().
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return translate([&] {
    if (nargs != 6 && nargs != 7)
      throw InvalidArgument("fast_call takes (comm, coll, x, out, op, algorithm[, root])");
    Comm& c = py::handle(args[0]).cast<Comm&>();
    const Coll coll = coll_arg(args[1]);
    const std::string op = utf8(args[4], "op"), algo = utf8(args[5], "algorithm");
    const int root = nargs == 7 ? root_arg(args[6]) : 0;
    call(c, coll, py::reinterpret_borrow<py::object>(args[2]),
         py::reinterpret_borrow<py::object>(args[3]), op, root, -1, 0, algo, std::nullopt, false,
         "");
  });
}

PyMethodDef fast_call_def = {"fast_call",
                             reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_call)),
                             METH_FASTCALL, "fast_call(comm, coll, x, out, op, algorithm)"};

}  // namespace

void bind_comm(py::module_& m) {
  m.attr("fast_call") = py::reinterpret_steal<py::object>(PyCFunction_New(&fast_call_def, nullptr));
  m.attr("fast_host") = py::reinterpret_steal<py::object>(PyCFunction_New(&fast_host_def, nullptr));
  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_static("bytes_needed", &Segment::bytes_needed)
      .def("unlink", &Segment::unlink);
  auto params = [](const std::string& name, int size, size_t staging, size_t pair_slot, uint64_t t0,
                   uint64_t t1, uint32_t flight) {
    Segment::Params p;
    p.flight_slots = flight;
    p.name = name;
    p.size = size;
    p.staging_bytes = staging;
    p.pair_slot_bytes = pair_slot;
    p.token[0] = t0;
    p.token[1] = t1;
    return p;
  };
  m.def(
      "create_segment",
      [params](const std::string& name, int size, size_t staging, size_t pair_slot, uint64_t t0,
               uint64_t t1, uint32_t flight) {
        return std::shared_ptr<Segment>(
            Segment::create(params(name, size, staging, pair_slot, t0, t1, flight)));
      },
      py::arg("name"), py::arg("size"), py::arg("staging"), py::arg("pair_slot"), py::arg("t0"),
      py::arg("t1"), py::arg("flight") = 0);
  m.def(
      "open_segment",
      [params](const std::string& name, int size, size_t staging, size_t pair_slot, uint64_t t0,
               uint64_t t1, uint32_t flight) {
        return std::shared_ptr<Segment>(
            Segment::open(params(name, size, staging, pair_slot, t0, t1, flight)));
      },
      py::arg("name"), py::arg("size"), py::arg("staging"), py::arg("pair_slot"), py::arg("t0"),
      py::arg("t1"), py::arg("flight") = 0);
  m.def(
      "reduce_arrays",
      [](py::array out, const std::vector<py::array>& srcs, const std::string& dtype,
         const std::string& op, int avg_divisor) {
        // The host-side arithmetic of layers above the core (the multi-host path's avg and its MPI
        // engine's half-type reductions) on plait's own kernels: float32 accumulation for half
        // types, one rounding, left to right.
        const DType dt = parse_dtype(dtype);
        const size_t esize = dtype_size(dt);
        auto check = [&](const py::array& a, const char* what) {
          if (!(a.flags() & py::array::c_style) || a.itemsize() != py::ssize_t(esize) ||
              a.size() != out.size())
            throw InvalidArgument(std::string("reduce_arrays: ") + what +
                                  " must be C-contiguous with " + std::to_string(out.size()) +
                                  " elements of " + dtype);
        };
        check(out, "out");
        if (!out.writeable()) throw InvalidArgument("reduce_arrays: out is read-only");
        if (srcs.empty() || srcs.size() > 32)
          throw InvalidArgument("reduce_arrays: 1 to 32 sources");
        std::vector<const void*> ptrs;
        for (const auto& s : srcs) {
          check(s, "every source");
          ptrs.push_back(s.data());
        }
        const RedOp rop = parse_op(op);
        py::gil_scoped_release nogil;
        reduce(dt, rop, out.mutable_data(), ptrs.data(), int(ptrs.size()), size_t(out.size()),
               avg_divisor);
      },
      py::arg("out"), py::arg("srcs"), py::arg("dtype"), py::arg("op"), py::arg("avg_divisor") = 0,
      "out = srcs[0] op srcs[1] op ... (left to right; half types in float32, rounded once); with "
      "op avg and avg_divisor > 0 the result is divided by it. out may be one of the sources.");
  m.def(
      "flush_traces",
      [] {
        py::gil_scoped_release nogil;
        Trace::flush_all();
      },
      "Writes every communicator's pending trace slices (PLAIT_TRACE); plait calls it at exit.");

  py::class_<Task, std::shared_ptr<Task>>(m, "Task")
      .def(
          "wait",
          [](Task& t, std::optional<double> timeout) {
            py::gil_scoped_release nogil;
            return t.wait(timeout);
          },
          py::arg("timeout") = py::none())
      .def("done", &Task::done)
      .def(
          "poll",
          [](Task& t) {
            t.start();
            return t.done();
          },
          "done(); a call plait left to its waiter (core/wakeup.h) starts now, since a caller "
          "that polls may not wait soon.");

  m.def(
      "check_env", [] { check_env(); },
      "Raises InvalidArgument for a PLAIT_* setting a Communicator would refuse (PLAIT_ALGO, "
      "PLAIT_ASYNC_GRACE_US, PLAIT_ASYNC_DEFER_BYTES).");

  // Every communicator's calls (and the C API's) enter through Comm (core/comm.h); the flat
  // shared-memory one adds its segment's own properties.
  py::class_<Comm, std::shared_ptr<Comm>>(m, "_Comm")
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("closed", &Comm::closed)
      .def_property("label", &Comm::label, &Comm::set_label)
      .def(
          "run_here",
          [](Comm& c, const std::shared_ptr<Task>& t) {
            py::gil_scoped_release nogil;
            return c.run_here(t);
          },
          py::arg("task"),
          "Runs an async task on this thread if it is next in line (a caller about to wait on "
          "it); true if it is finished.")
      .def("finalize",
           [](Comm& c) {
             py::gil_scoped_release nogil;
             c.finalize();
           })
      .def(
          "fail",
          [](Comm& c, const std::string& msg, const std::string& kind) {
            // Aborts the communicator on every rank and raises; kind: invalid (default) or
            // mismatch.
            c.fail(kind == "mismatch" ? ErrorKind::mismatch : ErrorKind::invalid, msg);
          },
          py::arg("msg"), py::arg("kind") = "invalid")
      .def("call",
           [](Comm& c, int coll, const py::object& x, const py::object& out, const std::string& op,
              int root, int peer, int64_t tag, const std::string& algo,
              std::optional<double> timeout, bool async, const std::string& dtype) {
             if (coll < 0 || coll >= int(Coll::kCount))
               throw InvalidArgument("bad collective code");
             return call(c, Coll(coll), x, out, op, root, peer, tag, algo, timeout, async, dtype);
           });
  py::class_<Communicator, Comm, std::shared_ptr<Communicator>>(m, "Communicator")
      .def(py::init([](std::shared_ptr<Segment> seg, int rank, double timeout,
                       const std::string& algo, bool oversubscribed, double init_timeout,
                       std::vector<int32_t> peer_pids) {
             Options o;
             o.peer_pids = std::move(peer_pids);
             o.timeout_s = timeout;
             o.algo_override = algo;
             o.oversubscribed = oversubscribed;
             o.init_timeout_s = init_timeout;
             py::gil_scoped_release nogil;
             return new Communicator(std::move(seg), rank, o);
           }),
           py::arg("segment"), py::arg("rank"), py::arg("timeout"), py::arg("algo_override") = "",
           py::arg("oversubscribed") = false, py::arg("init_timeout") = 300.0,
           py::arg("peer_pids") = std::vector<int32_t>{})
      .def_property_readonly("single_copy", &Communicator::single_copy)
      .def_property_readonly("mapped_bytes", &Communicator::mapped_bytes)
      .def_property_readonly("single_copy_unavailable", &Communicator::single_copy_unavailable)
      .def(
          "flight_json",
          [](Communicator& c) {
            py::gil_scoped_release nogil;
            return c.flight_json();
          },
          "Every rank's last calls from the flight recorder, as JSON text.")
      .def("_flight_scribble", &Communicator::flight_scribble, py::arg("rank"), py::arg("seed"),
           "Test hook: overwrites rank's flight ring with garbage drawn from seed.");
  py::dict codes;
  for (int c = 0; c < int(Coll::kCount); ++c) codes[coll_name(Coll(c))] = c;
  m.attr("COLLECTIVES") = codes;
  py::dict ops;  // the reduction codes, so Python never numbers them by hand
  for (int o = 0; o < int(RedOp::kCount); ++o) ops[op_name(RedOp(o))] = o;
  m.attr("OPS") = ops;
}

}  // namespace plait
