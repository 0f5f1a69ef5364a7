// Bindings for the GPU path: the host-side planners (every build, so CPU tests check them), build
// facts, the GPU call path (a communicator's GPU queue, and a recording queue for CPU tests), and,
// in CUDA builds, NCCL loading and the GPU transports' queues. Device arrays cross as
// (pointer, bytes, device) read from __cuda_array_interface__ / torch by plait._arrays, which
// keeps their owners alive for the call; the GIL is released while C++ works.
#include <cstring>
#include <optional>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "algo/algo.h"
#include "algo/plan.h"
#include "core/communicator.h"
#include "core/device.h"
#include "core/watchdog.h"
#include "hier/hier_comm.h"

#if PLAIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda/stream_queue.h"
#include "reduce/reduce_cuda.h"
#include "transport/cuda_ipc.h"
#include "transport/nccl.h"
#endif

namespace py = pybind11;

namespace plait {
namespace {

DType dtype_named(const std::string& s) {
  for (int t = 0; t < int(DType::kCount); ++t)
    if (s == dtype_name(DType(t))) return DType(t);
  throw InvalidArgument("unsupported dtype '" + s + "'");
}

RedOp op_named(const std::string& s) {
  for (int o = 0; o < int(RedOp::kCount); ++o)
    if (s == op_name(RedOp(o))) return RedOp(o);
  throw InvalidArgument("unknown op '" + s + "' (sum, prod, min, max, avg)");
}

int device_count() {
#if PLAIT_WITH_CUDA
  int n = 0;
  // No driver or no device is an answer (0), not an error.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

// The GPU communicators' hooks into the CPU communicator of the same ranks.
GpuPeers cpu_peers(Communicator* c) {
  return GpuPeers{[c] { c->throw_if_aborted(); },
                  [c](ErrorKind k, const std::string& msg) { c->abort_all(k, msg); },
                  [c] { return c->dead_peer(); }};
}

// A stand-in GPU communicator for CPU tests of the watchdog (every build): events are numbers a
// test marks done (1), failed (-1) or pending (0); abort() records what the watchdog said and
// tells the CPU communicator, as the GPU communicators do.
class WatchdogProbe {
 public:
  WatchdogProbe(Communicator* cpu, double interval_s) : peers_(cpu ? cpu_peers(cpu) : GpuPeers{}) {
    Watchdog::Hooks h;
    h.create = [this] {
      std::lock_guard<std::mutex> lock(mu_);
      state_.push_back(0);
      return reinterpret_cast<Watchdog::Event>(uintptr_t(state_.size()));
    };
    h.destroy = [](Watchdog::Event) {};
    h.query = [this](Watchdog::Event e, std::string* why) {
      std::lock_guard<std::mutex> lock(mu_);
      const int st = state_[id(e) - 1];
      if (st < 0) *why = "cudaErrorLaunchFailure";
      return st;
    };
    h.poll = [this](ErrorKind* k) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++polls_;
        if (!poll_error_.empty()) {
          *k = ErrorKind::generic;
          return poll_error_;
        }
      }
      return peers_.why_stuck(k);
    };
    h.abort = [this](ErrorKind k, const std::string& m) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        static const char* const names[] = {"none",     "generic", "invalid",
                                            "mismatch", "timeout", "peer_lost"};
        aborts_.push_back(std::string(names[int(k)]) + ": " + m);
      }
      peers_.tell(k, m);
    };
    wd_ = std::make_unique<Watchdog>(std::move(h), interval_s);
  }
  ~WatchdogProbe() { wd_.reset(); }

  // One call: (start event, end event), both pending.
  std::pair<int64_t, int64_t> issue(double timeout_s, const std::string& what) {
    Watchdog::Event a = wd_->acquire(), b = wd_->acquire();
    set(id(a), 0);
    set(id(b), 0);
    wd_->track(a, b, timeout_s, what);
    return {id(a), id(b)};
  }
  void set(int64_t ev, int st) {
    std::lock_guard<std::mutex> lock(mu_);
    state_.at(size_t(ev - 1)) = st;
  }
  void set_poll_error(const std::string& e) {
    std::lock_guard<std::mutex> lock(mu_);
    poll_error_ = e;
  }
  std::vector<std::string> aborts() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborts_;
  }
  int64_t events() {
    std::lock_guard<std::mutex> lock(mu_);
    return int64_t(state_.size());
  }
  int64_t polls() {
    std::lock_guard<std::mutex> lock(mu_);
    return polls_;
  }
  Watchdog& wd() { return *wd_; }

 private:
  static int64_t id(Watchdog::Event e) { return int64_t(reinterpret_cast<uintptr_t>(e)); }
  GpuPeers peers_;
  std::mutex mu_;
  std::vector<int> state_;
  std::vector<std::string> aborts_;
  std::string poll_error_;
  int64_t polls_ = 0;
  std::unique_ptr<Watchdog> wd_;
};

// A device buffer from a plait._arrays.GpuArray (pointer, bytes, device, and the owner that
// keeps the memory alive while the caller holds it), or None (reduce's output on a non-root,
// send's output, recv's input). `dtype` is the call's, which dtype= may set apart from the
// array's own; the call runs on `stream`.
Buffer gpu_buffer(const py::object& o, const std::string& dtype, uintptr_t stream) {
  Buffer b;
  b.dtype = dtype_named(dtype);
  b.device = Device::cuda;
  b.stream = stream;
  if (o.is_none()) return b;
  if (!py::hasattr(o, "owner") || !py::hasattr(o, "ptr"))
    throw InvalidArgument("a GPU buffer must come from plait._arrays (a GpuArray), got " +
                          py::str(py::type::of(o).attr("__name__")).cast<std::string>());
  b.ptr = reinterpret_cast<void*>(o.attr("ptr").cast<uintptr_t>());
  b.bytes = o.attr("nbytes").cast<size_t>();
  b.device_index = o.attr("device").cast<int>();
  b.present = true;
  return b;
}

// The arguments both GPU entries take, in Python's order.
#define PLAIT_GPU_CALL_ARGS                                                        \
  py::arg("coll"), py::arg("in"), py::arg("out"), py::arg("dtype"), py::arg("op"), \
      py::arg("algo"), py::arg("stream"), py::arg("timeout"), py::arg("root") = 0, \
                                                              py::arg("peer") = -1

}  // namespace

void bind_gpu(py::module_& m) {
  m.attr("CUDA_COMPILED") = bool(PLAIT_WITH_CUDA);
  m.def("cuda_device_count", &device_count,
        "CUDA devices visible to this process (0: none, no driver, or a CPU-only build).");
  m.def(
      "cuda_pointer_device",
      [](uintptr_t ptr) {
#if PLAIT_WITH_CUDA
        cudaPointerAttributes a;
        if (cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
          cudaGetLastError();
          return -1;
        }
        return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
#else
        return -1;
#endif
      },
      py::arg("ptr"),
      "The CUDA device a pointer lives on, or -1 (host memory, no driver, CPU-only build).");
  m.def(
      "gpu_plan_chunks",
      [](int64_t count, int64_t chunk) {
        std::vector<std::pair<int64_t, int64_t>> v;
        for (const Span& s : chunk_plan(count, chunk)) v.emplace_back(s.offset, s.count);
        return v;
      },
      py::arg("count"), py::arg("chunk_elems"));
  m.def(
      "gpu_plan_ring",
      [](int rank, int n) {
        const RingPlan p = ring_plan(rank, n);
        py::dict d;
        d["left"] = p.left;
        d["right"] = p.right;
        for (const char* k : {"reduce_scatter", "allgather"}) {
          std::vector<std::pair<int, int>> steps;
          for (const RingStep& s : std::string(k) == "allgather" ? p.allgather : p.reduce_scatter)
            steps.emplace_back(s.send_block, s.recv_block);
          d[k] = steps;
        }
        return d;
      },
      py::arg("rank"), py::arg("size"));
  m.def(
      "gpu_plan_ipc_ring",
      [](const std::string& coll, int rank, int n, int64_t count, int64_t slot_elems) {
        static const char* const kinds[] = {"load", "reduce", "finish", "gather"};
        std::vector<py::tuple> v;
        for (const IpcRingStep& s : ipc_ring_plan(coll_named(coll), rank, n, count, slot_elems))
          v.push_back(py::make_tuple(kinds[s.kind], s.block, s.in_offset, s.out_offset, s.count,
                                     s.read, s.post));
        return v;
      },
      py::arg("collective"), py::arg("rank"), py::arg("size"), py::arg("count"),
      py::arg("slot_elems"),
      "An IPC ring's steps: (kind, block, in offset, out offset, count, read epoch, post epoch); 0 "
      "is none.");
  m.def("gpu_timeout_ns", &gpu_timeout_ns, py::arg("seconds"),
        "A GPU wait kernel's timeout, clamped.");
  m.def(
      "gpu_plan_parts",
      [](int64_t count, int n, int64_t align) {
        std::vector<int64_t> v;
        for (int q = 0; q <= n; ++q) v.push_back(aligned_part_begin(count, n, q, align));
        return v;
      },
      py::arg("count"), py::arg("parts"), py::arg("align"),
      "Where each part begins (and the end), aligned.");
  py::class_<WatchdogProbe>(m, "_WatchdogProbe")
      .def(py::init([](py::object cpu, double interval_s) {
             Communicator* c = cpu.is_none() ? nullptr : &cpu.cast<Communicator&>();
             return std::make_unique<WatchdogProbe>(c, interval_s);
           }),
           py::arg("cpu"), py::arg("interval_s") = 1e-3, py::keep_alive<1, 2>())
      .def("issue", &WatchdogProbe::issue, py::arg("timeout"), py::arg("what"))
      .def("set", &WatchdogProbe::set, py::arg("event"), py::arg("state"))
      .def("set_poll_error", &WatchdogProbe::set_poll_error)
      .def("aborts", &WatchdogProbe::aborts)
      .def("events", &WatchdogProbe::events)
      .def("polls", &WatchdogProbe::polls)
      .def("in_flight", [](WatchdogProbe& p) { return p.wd().in_flight(); })
      .def("fired", [](WatchdogProbe& p) { return p.wd().fired(); })
      .def("drain", [](WatchdogProbe& p, double max_s) {
        py::gil_scoped_release nogil;
        return p.wd().drain(max_s);
      });
  m.def(
      "gpu_plan_tree",
      [](int rank, int n) {
        const TreeLinks t = tree_links(rank, n);
        return py::make_tuple(t.parent, t.children);
      },
      py::arg("rank"), py::arg("size"));

  py::class_<DeviceQueue, std::shared_ptr<DeviceQueue>>(m, "GpuQueue")
      .def_property_readonly("device", &DeviceQueue::device)
      .def_property_readonly("rank", &DeviceQueue::rank)
      .def_property_readonly("size", &DeviceQueue::size)
      .def_property_readonly("transport", [](DeviceQueue& q) { return std::string(q.transport()); })
      .def(
          "call",
          [](DeviceQueue& q, const std::string& coll, py::object in, py::object out,
             const std::string& dtype, const std::string& op, const std::string& algo,
             uintptr_t stream, double timeout, int root, int peer) {
            const Buffer i = gpu_buffer(in, dtype, stream), o = gpu_buffer(out, dtype, stream);
            const Coll c = coll_named(coll);
            const RedOp r = op_named(op);
            py::gil_scoped_release nogil;
            q.call(c, i, o, r, root, peer, algo, timeout, nullptr);
          },
          PLAIT_GPU_CALL_ARGS,
          "A call on a queue standing alone (a multi-host job's flat NCCL queue), whose caller "
          "checks calls across ranks itself: validate -> select -> enqueue.")
      .def(
          "resolve",
          [](DeviceQueue& q, const std::string& coll, const std::string& algo) {
            return std::string(q.resolve(coll_named(coll), algo));
          },
          py::arg("coll"), py::arg("algo"),
          "The algorithm `algo` (auto, or a name) runs as here; InvalidArgument if none.")
      .def("finalize", [](DeviceQueue& q) {
        py::gil_scoped_release nogil;
        q.finalize();
      });
  py::class_<FakeDeviceQueue, DeviceQueue, std::shared_ptr<FakeDeviceQueue>>(m, "_FakeGpuQueue")
      .def(py::init([](Communicator& cpu, int device, const std::string& transport, double timeout,
                       const std::string& algo_override, int rank, int size) {
             // rank/size: of a queue spanning hosts (cpu is then the host's communicator)
             return std::make_shared<FakeDeviceQueue>(
                 rank < 0 ? cpu.rank() : rank, size < 0 ? cpu.size() : size, device, transport,
                 timeout, algo_override, cpu_peers(&cpu));
           }),
           py::arg("cpu"), py::arg("device") = 0, py::arg("transport") = "nccl",
           py::arg("timeout") = 300.0, py::arg("algo_override") = "", py::arg("rank") = -1,
           py::arg("size") = -1, py::keep_alive<1, 2>())
      .def(
          "record", [](FakeDeviceQueue&, uintptr_t, double) { return py::none(); },
          py::arg("stream"), py::arg("timeout"),
          "No event: the recording queue enqueues nothing (an async call's handle holds None).")
      .def("records",
           [](FakeDeviceQueue& q) {
             py::list out;
             for (const auto& r : q.records())
               out.append(py::make_tuple(r.coll, r.algo, r.count, r.stream));
             return out;
           })
      .def(
          "log",
          [](FakeDeviceQueue& q) {
            py::list out;
            for (const auto& r : q.records()) {
              py::dict d;
              d["coll"] = r.coll, d["algo"] = r.algo, d["count"] = r.count;
              d["stream"] = r.stream, d["in"] = r.in, d["out"] = r.out;
              d["dtype"] = dtype_name(r.dtype), d["op"] = op_name(r.op);
              d["root"] = r.root, d["peer"] = r.peer, d["seq"] = r.seq;
              out.append(d);
            }
            return out;
          },
          "Every call enqueued, in order, with all it was handed (dicts).");
  // The counter FakeDeviceQueue numbers its records with, for a test's fake CUDA events
  // (plait.torch's native module) to number theirs in one order with them.
  m.attr("_fake_gpu_clock") =
      py::capsule(static_cast<void*>(&fake_gpu_clock()), "plait.fake_gpu_clock");
  m.def(
      "gpu_attach",
      [](Comm& c, std::shared_ptr<DeviceQueue> q) {
        if (auto* flat = dynamic_cast<Communicator*>(&c)) return flat->attach_device(std::move(q));
        if (auto* hier = dynamic_cast<HierComm*>(&c)) return hier->attach_device(std::move(q));
        throw InvalidArgument("gpu_attach: not a plait communicator");
      },
      py::arg("cpu"), py::arg("queue"),
      "Makes `queue` the communicator's GPU transport: its GPU calls are enqueued there.");
  m.def(
      "gpu_call",
      [](Communicator& cpu, const std::string& coll, py::object in, py::object out,
         const std::string& dtype, const std::string& op, const std::string& algo, uintptr_t stream,
         double timeout, int root, int peer) {
        const Buffer i = gpu_buffer(in, dtype, stream), o = gpu_buffer(out, dtype, stream);
        const Coll c = coll_named(coll);
        const RedOp r = op_named(op);
        const std::optional<double> t = timeout < 0 ? std::nullopt : std::optional<double>(timeout);
        py::gil_scoped_release nogil;
        cpu.call(c, i, o, r, root, peer, 0, algo, t, false);
      },
      py::arg("cpu"), PLAIT_GPU_CALL_ARGS,
      "A GPU call on a communicator: the same path as a host call (validate -> select -> check "
      "-> run), enqueued on `stream` by the attached GPU queue. timeout < 0: the queue's.");

#if PLAIT_WITH_CUDA
  m.def(
      "nccl_load",
      [](const std::string& path) {
        py::gil_scoped_release nogil;
        return nccl_load(path).version;
      },
      py::arg("path"), "Loads NCCL (once per process) and returns its version code.");
  m.def(
      "nccl_unique_id",
      [](const std::string& path) {
        nccl::UniqueId id;
        {
          py::gil_scoped_release nogil;
          const NcclApi& api = nccl_load(path);
          const nccl::Result r = api.GetUniqueId(&id);
          if (r != nccl::Success)
            throw PlaitError(std::string("ncclGetUniqueId failed: ") + api.GetErrorString(r));
        }
        return py::bytes(id.internal, sizeof id.internal);
      },
      py::arg("path"));
  m.def(
      "cuda_device_uuid",
      [](int device) {
        cudaDeviceProp p;
        const cudaError_t e = cudaGetDeviceProperties(&p, device);
        if (e != cudaSuccess)
          throw PlaitError("cudaGetDeviceProperties(" + std::to_string(device) +
                           "): " + cudaGetErrorString(e));
        return py::bytes(p.uuid.bytes, sizeof p.uuid.bytes);
      },
      py::arg("device"));
  // The kernels alone, for tests/gpu and the bench: device pointers as integers is acceptable
  // only here, behind a private name, because the callers own and hold the arrays.
  m.def("_reduce_cuda", [](const std::string& dtype, const std::string& op, uintptr_t dst,
                           uintptr_t a, uintptr_t b, size_t count, int avg_divisor,
                           uintptr_t stream) {
    py::gil_scoped_release nogil;
    cudaPointerAttributes at;
    if (cudaPointerGetAttributes(&at, reinterpret_cast<const void*>(dst)) != cudaSuccess ||
        at.device < 0)
      throw InvalidArgument("_reduce_cuda: dst is not device memory");
    DeviceGuard g(at.device);  // launch on the GPU that holds the data, as torch/cupy chose it
    reduce_cuda(dtype_named(dtype), op_named(op), reinterpret_cast<void*>(dst),
                reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), count,
                avg_divisor, nullptr, reinterpret_cast<cudaStream_t>(stream));
  });

  py::class_<GpuEvent, std::shared_ptr<GpuEvent>>(m, "GpuEvent")
      .def(
          "wait",
          [](GpuEvent& e, double timeout) {
            py::gil_scoped_release nogil;
            return e.wait(timeout);
          },
          py::arg("timeout") = -1.0)
      .def("done", &GpuEvent::done)
      .def(
          "block",
          [](GpuEvent& e, uintptr_t stream) { e.block(reinterpret_cast<cudaStream_t>(stream)); },
          py::arg("stream"), "Makes `stream` wait for the call on the GPU; returns at once.");

  py::class_<StreamQueue, DeviceQueue, std::shared_ptr<StreamQueue>>(m, "StreamQueue")
      .def("handle", [](StreamQueue& q) { return py::bytes(q.handle()); })
      .def("open",
           [](StreamQueue& q, const std::vector<py::bytes>& handles) {
             std::vector<std::string> h;
             for (const py::bytes& b : handles) h.push_back(b);
             py::gil_scoped_release nogil;
             q.open(h);
           })
      .def(
          "record",
          [](std::shared_ptr<StreamQueue> q, uintptr_t stream, double timeout) {
            return std::make_shared<GpuEvent>(std::static_pointer_cast<GpuWork>(q),
                                              reinterpret_cast<cudaStream_t>(stream), timeout);
          },
          py::arg("stream"), py::arg("timeout"),
          "An event at the end of the calls enqueued on `stream` so far.");

  // rank/size >= 0: the NCCL communicator spans more ranks than `cpu` (a hierarchical job: cpu
  // is the host-local communicator, whose abort stops this host's peers; other hosts learn of an
  // error through NCCL's own errors and the call's deadline). Such a queue stands alone; one of
  // cpu's own ranks is attached to it (Communicator.attach_gpu).
  m.def(
      "nccl_queue",
      [](Communicator& cpu, const py::bytes& uid, int device, double timeout, int64_t chunk_bytes,
         const std::string& algo, const std::string& nccl_path, int rank, int size) {
        if (rank < 0 && size < 0) rank = cpu.rank(), size = cpu.size();
        if (size < 1 || rank < 0 || rank >= size)
          throw InvalidArgument("nccl_queue: rank " + std::to_string(rank) + " of size " +
                                std::to_string(size) + ": need 0 <= rank < size (or both -1)");
        const std::string id = uid;
        if (id.size() != size_t(nccl::kUniqueIdBytes))
          throw InvalidArgument("NCCL unique id must be 128 bytes");
        nccl::UniqueId u;
        std::memcpy(u.internal, id.data(), id.size());
        GpuPeers peers = cpu_peers(&cpu);
        py::gil_scoped_release nogil;
        auto tp = std::make_unique<NcclTransport>(nccl_load(nccl_path), u, rank, size, device,
                                                  chunk_bytes);
        return std::make_shared<StreamQueue>(std::move(tp), rank, size, device, timeout, algo,
                                             std::move(peers));
      },
      py::arg("cpu"), py::arg("unique_id"), py::arg("device"), py::arg("timeout"),
      py::arg("chunk_bytes"), py::arg("algo_override"), py::arg("nccl_path"), py::arg("rank") = -1,
      py::arg("size") = -1, py::keep_alive<0, 1>(),
      "The GPU queue over NCCL (ncclCommInitRankConfig: a collective of every rank).");
  m.def(
      "ipc_queue",
      [](Communicator& cpu, int device, double timeout, size_t staging_bytes) {
        GpuPeers peers = cpu_peers(&cpu);
        py::gil_scoped_release nogil;
        auto tp = std::make_unique<CudaIpcTransport>(cpu.rank(), cpu.size(), device, staging_bytes);
        return std::make_shared<StreamQueue>(std::move(tp), cpu.rank(), cpu.size(), device, timeout,
                                             "", std::move(peers));
      },
      py::arg("cpu"), py::arg("device"), py::arg("timeout"), py::arg("staging_bytes"),
      py::keep_alive<0, 1>(),
      "The GPU queue over CUDA IPC: exchange handle() with every rank, then open() them all.");
#endif
}

}  // namespace plait
