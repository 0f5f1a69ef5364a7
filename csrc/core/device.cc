// The GPU call path (validate -> select -> check -> enqueue), the algorithm override and the
// choice of a GPU row, and the recording queue CPU tests drive it with.
#include "core/device.h"

namespace plait {

const Algorithm& resolve_device_algo(Coll c, const std::string& algo, Caps caps,
                                     const AlgoOverride& ov, int rank) {
  const bool ipc = (caps & kCapCudaIpc) != 0;
  const auto& algos = algorithms_for(c, caps);
  const std::string head = "rank " + std::to_string(rank) + ": " + coll_name(c);
  if (algos.empty() && ipc)
    throw InvalidArgument(
        head +
        " of GPU arrays has no path over the CUDA IPC transport (ranks sharing a GPU) in this "
        "version: it runs over NCCL, with one GPU per rank; IPC has allreduce, reduce_scatter "
        "and allgather");
  if (algos.empty()) throw InvalidArgument(head + " of GPU arrays has no GPU path in this version");
  static const AlgoOverride none;
  std::string why;
  const int i = select_algorithm(c, algo, ipc ? none : ov, caps, AutoInputs{caps}, rank, "", &why);
  if (i >= 0) return *algos[size_t(i)];
  throw InvalidArgument(why + (ipc ? " over the CUDA IPC transport; the others run over NCCL, "
                                     "with one GPU per rank"
                                   : " over NCCL"));
}

void DeviceQueue::call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
                       const std::string& algo, double timeout_s, const Check& check) {
  std::lock_guard<std::mutex> lock(issue_mu_);
  throw_if_failed();
  CallArgs a;
  std::string why = validate_call(c, in, out, op, root, peer, 0,
                                  timeout_s >= 0 ? timeout_s : timeout_s_, rank_, size_,
                                  /*any_source=*/false, &a);
  const Buffer& any = in.present ? in : out;
  if (why.empty() && any.device_index != device_)
    why = "rank " + std::to_string(rank_) + ": " + coll_name(c) + ": the arrays are on GPU " +
          std::to_string(any.device_index) + "; this communicator's GPU work runs on GPU " +
          std::to_string(device_);
  // NCCL's alltoall sends from the input while it receives into the output.
  if (why.empty() && c == Coll::alltoall && in.present && out.present && in.bytes &&
      static_cast<const char*>(in.ptr) < static_cast<const char*>(out.ptr) + out.bytes &&
      static_cast<const char*>(out.ptr) < static_cast<const char*>(in.ptr) + in.bytes)
    why = "rank " + std::to_string(rank_) +
          ": alltoall: input and output overlap (alltoall cannot run in place on a GPU)";
  if (c == Coll::barrier && why.empty())
    why = "rank " + std::to_string(rank_) + ": barrier takes no GPU arrays";
  const Algorithm* alg = nullptr;
  if (why.empty()) {
    try {
      alg = &resolve_device_algo(c, algo, caps(), ov_, rank_);
    } catch (const InvalidArgument& e) {
      why = e.what();
    }
  }
  // Bad input aborts the call on every rank, as on the host path; no peer then waits on GPU
  // work this rank will never enqueue.
  if (!why.empty()) fail(ErrorKind::invalid, why);
  if (check && c != Coll::send && c != Coll::recv) check(a, alg->name);
  enqueue(*alg, a, any.stream);
}

std::atomic<uint64_t>& fake_gpu_clock() {
  static std::atomic<uint64_t> clock{0};
  return clock;
}

FakeDeviceQueue::FakeDeviceQueue(int rank, int size, int device, const std::string& transport,
                                 double timeout_s, const std::string& algo_override, GpuPeers peers)
    : DeviceQueue(rank, size, device, timeout_s, algo_override),
      transport_(transport),
      caps_(transport_caps(transport)),
      peers_(std::move(peers)) {
  if (!(caps_ & (kCapCudaIpc | kCapNcclP2p)))
    throw InvalidArgument("a fake GPU queue stands in for nccl or ipc, not " + transport);
}

std::vector<FakeDeviceQueue::Record> FakeDeviceQueue::records() {
  std::lock_guard<std::mutex> lock(mu_);
  return records_;
}

void FakeDeviceQueue::throw_if_failed() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_)
      throw_error(first_kind_, "GPU communicator aborted after an earlier error: " + first_error_);
  }
  if (peers_.throw_if_aborted) peers_.throw_if_aborted();
}

void FakeDeviceQueue::fail(ErrorKind kind, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) failed_ = true, first_kind_ = kind, first_error_ = msg;
  }
  peers_.tell(kind, msg);
  throw_error(kind, msg);
}

void FakeDeviceQueue::enqueue(const Algorithm& alg, const CallArgs& a, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  records_.push_back(Record{coll_name(a.coll), alg.name, a.count, stream,
                            reinterpret_cast<uintptr_t>(a.in), reinterpret_cast<uintptr_t>(a.out),
                            a.dtype, a.op, a.root, a.peer, ++fake_gpu_clock()});
}

}  // namespace plait
