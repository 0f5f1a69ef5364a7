// A recording CUDA device for tests on machines without one (a CPU-only torch): torch's device
// registry gets a CUDA guard whose streams are numbers and whose events are log entries, and
// tensors "on" it are CPU memory labelled cuda:N (made here, with from_blob). dist.* calls on
// them then reach the backend's CUDA path (gpu.cc) as on a GPU machine, through torch's own
// dispatcher and c10d's CUDA registrations. Plait's calls land in the communicator's recording
// GPU queue (plait._C._FakeGpuQueue); its records and this log take their numbers from one
// counter, so a test reads the order "enqueued, event recorded, waited on". Nothing runs on any
// GPU: plait's calls move no data; torch ops on such tensors run on the host (host_fallback), so
// the backend's steps around its calls run too.
//
// install() refuses when torch has a real CUDA device type registered.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>
#include <torch/python.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace plait_torch {
namespace {

namespace ci = c10::impl;

struct Entry {
  std::string what;  // record, block, query, record_stream, synchronize
  int64_t event;     // event number (record_stream: the data pointer)
  int64_t stream;    // stream id (query: 1 if complete)
  uint64_t seq;
};

struct State {
  std::mutex mu;
  std::atomic<uint64_t>* clock = nullptr;
  std::vector<Entry> log;
  std::map<int, int64_t> current;  // device -> current stream id
  std::map<int64_t, bool> done;    // event -> the fake GPU got past it
  int64_t next_event = 0;
  int64_t pool = 0;  // pool streams handed out
  int device = 0;
  void add(const char* what, int64_t a, int64_t b) { log.push_back(Entry{what, a, b, ++*clock}); }
};

State& state() {
  static State* s = new State;  // the guard outlives every test; never destroyed
  return *s;
}

// A stream's cudaStream_t stand-in: 0 for stream 0 (CUDA's legacy default), else distinct.
uintptr_t handle_of(int64_t id) { return id == 0 ? 0 : uintptr_t(0x5EA0000 + id); }

struct RecordingCudaGuard final : ci::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return c10::DeviceType::CUDA; }
  c10::Device exchangeDevice(c10::Device d) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    c10::Device old(c10::DeviceType::CUDA, c10::DeviceIndex(s.device));
    s.device = d.index();
    return old;
  }
  c10::Device getDevice() const override {
    std::lock_guard<std::mutex> lk(state().mu);
    return c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(state().device));
  }
  void setDevice(c10::Device d) const override { uncheckedSetDevice(d); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    std::lock_guard<std::mutex> lk(state().mu);
    state().device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    std::lock_guard<std::mutex> lk(state().mu);
    return c10::Stream(c10::Stream::UNSAFE, d, state().current[d.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, 0);
  }
  // Future.then runs its callback on a pool stream: numbered from 100 (none of the tests' own).
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    return c10::Stream(c10::Stream::UNSAFE, d, 100 + s.pool++);
  }
  c10::Stream exchangeStream(c10::Stream st) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    const int64_t old = s.current[st.device_index()];
    s.current[st.device_index()] = st.id();
    return c10::Stream(c10::Stream::UNSAFE, st.device(), old);
  }
  void* getStreamNativeHandle(const c10::Stream st) const override {
    return reinterpret_cast<void*>(handle_of(st.id()));
  }
  void record(void** event, const c10::Stream& st, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    if (!*event) *event = reinterpret_cast<void*>(++s.next_event);
    const auto id = reinterpret_cast<int64_t>(*event);
    s.done[id] = false;  // a new version of the event: not reached yet
    s.add("record", id, st.id());
  }
  void block(void* event, const c10::Stream& st) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    s.add("block", reinterpret_cast<int64_t>(event), st.id());
  }
  bool queryEvent(void* event) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    const auto id = reinterpret_cast<int64_t>(event);
    const bool done = !event || s.done[id];
    s.add("query", id, done);
    return done;
  }
  void synchronizeEvent(void* event) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    s.add("synchronize", reinterpret_cast<int64_t>(event), 0);
  }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void recordDataPtrOnStream(const c10::DataPtr& p, const c10::Stream& st) const override {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    s.add("record_stream", reinterpret_cast<int64_t>(p.get()), st.id());
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 2; }
};

// torch kernels on fake CUDA tensors (a CPU-only torch has none): every op without a CUDA kernel
// runs on CPU aliases of the same memory, and what it returns is labelled cuda again (an input
// handed back, as in-place ops do, is returned as the caller's own tensor). Steps the backend
// enqueues after a call (copies back, divisions, temporaries) then run, on the host.
at::Tensor cpu_alias(const at::Tensor& t) {
  auto* owner = new at::Tensor(t);
  return at::for_blob(t.data_ptr(), t.sizes())
      .strides(t.strides())
      .context(owner, [](void* p) { delete static_cast<at::Tensor*>(p); })
      .target_device(c10::Device(c10::kCPU))
      .options(t.options().device(c10::kCPU))
      .make_tensor();
}

at::Tensor cuda_label(const at::Tensor& t, c10::DeviceIndex device) {
  auto* owner = new at::Tensor(t);
  return at::for_blob(t.data_ptr(), t.sizes())
      .strides(t.strides())
      .context(owner, [](void* p) { delete static_cast<at::Tensor*>(p); })
      .target_device(c10::Device(c10::DeviceType::CUDA, device))
      .options(t.options().device(c10::DeviceType::CUDA, device))
      .make_tensor();
}

void host_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  std::vector<std::pair<at::Tensor, at::Tensor>> seen;  // (cpu alias, the caller's cuda tensor)
  c10::DeviceIndex device = 0;
  auto to_host = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_cuda()) return t;
    device = t.device().index();
    at::Tensor a = cpu_alias(t);
    seen.emplace_back(a, t);
    return a;
  };
  for (size_t i = stack->size() - n; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = to_host(v.toTensor());
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> ts;
      for (const at::Tensor& t : v.toTensorList()) ts.push_back(to_host(t));
      v = c10::IValue(ts);
    } else if (v.isDevice() && v.toDevice().is_cuda()) {
      device = v.toDevice().index();
      v = c10::IValue(c10::Device(c10::kCPU));
    }
  }
  op.callBoxed(stack);
  const size_t r = op.schema().returns().size();
  auto back = [&](const at::Tensor& t) {
    if (!t.defined() || !t.is_cpu()) return t;
    for (auto& [a, orig] : seen)
      if (t.unsafeGetTensorImpl() == a.unsafeGetTensorImpl()) return orig;
    return cuda_label(t, device);
  };
  for (size_t i = stack->size() - r; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      v = back(v.toTensor());
    } else if (v.isTensorList()) {
      std::vector<at::Tensor> ts;
      for (const at::Tensor& t : v.toTensorList()) ts.push_back(back(t));
      v = c10::IValue(ts);
    }
  }
}

}  // namespace

void bind_testing(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "_fake_cuda_install",
      [](py::capsule clock) {
        if (std::string(clock.name()) != "plait.fake_gpu_clock")
          throw std::runtime_error("not plait._C._fake_gpu_clock");
        auto& s = state();
        static RecordingCudaGuard* guard = nullptr;
        if (!guard) {
          if (ci::hasDeviceGuardImpl(c10::DeviceType::CUDA))
            throw std::runtime_error("torch has a CUDA device type: no fake one is installed");
          guard = new RecordingCudaGuard;
          ci::registerDeviceGuard(c10::DeviceType::CUDA, guard);
          static auto* lib = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::CUDA,
                                                __FILE__, __LINE__);
          lib->fallback(torch::CppFunction::makeFromBoxedFunction<&host_fallback>());
          // copy_ has a kernel for every backend, which wants the device's copy stub: run it here.
          static auto* aten = new torch::Library(torch::Library::IMPL, "aten",
                                                 c10::DispatchKey::CUDA, __FILE__, __LINE__);
          aten->impl("copy_", torch::CppFunction::makeFromBoxedFunction<&host_fallback>());
        }
        std::lock_guard<std::mutex> lk(s.mu);
        s.clock = static_cast<std::atomic<uint64_t>*>(clock.get_pointer());
      },
      "Installs the recording CUDA device in this process (tests only).");
  m.def(
      "_fake_cuda_tensor",
      [](const at::Tensor& like, int device) {
        // `like`'s memory and shape, labelled cuda:device; it keeps `like` alive.
        auto* owner = new at::Tensor(like);
        return at::for_blob(like.data_ptr(), like.sizes())
            .strides(like.strides())
            .context(owner, [](void* p) { delete static_cast<at::Tensor*>(p); })
            .target_device(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(device)))
            .options(like.options().device(c10::DeviceType::CUDA, c10::DeviceIndex(device)))
            .make_tensor();
      },
      py::arg("like"), py::arg("device") = 0);
  m.def("_fake_cuda_set_stream", [](int device, int64_t id) {
    std::lock_guard<std::mutex> lk(state().mu);
    state().current[device] = id;
  });
  m.def("_fake_cuda_stream_handle", [](int64_t id) { return handle_of(id); });
  m.def(
      "_fake_cuda_finish",
      [](int64_t event) {
        auto& s = state();
        std::lock_guard<std::mutex> lk(s.mu);
        for (auto& [id, done] : s.done)
          if (event < 0 || id == event) done = true;
      },
      "The fake GPU got past `event` (every event: -1).");
  m.def("_fake_cuda_log", [] {
    auto& s = state();
    std::lock_guard<std::mutex> lk(s.mu);
    py::list out;
    for (const auto& e : s.log) out.append(py::make_tuple(e.what, e.event, e.stream, e.seq));
    return out;
  });
}

}  // namespace plait_torch
