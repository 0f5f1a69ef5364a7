#include "world.h"

namespace host {

Buffer dev(void* p, size_t bytes, DType t, cudaStream_t s) {
  Buffer b;
  b.ptr = p;
  b.bytes = bytes;
  b.dtype = t;
  b.device = Device::cuda;
  b.device_index = 0;
  b.stream = reinterpret_cast<uintptr_t>(s);
  b.present = true;  // an empty vector's data() may be null
  return b;
}

void call_and_wait(Rank& r, Coll c, const Buffer& in, const Buffer& out, RedOp op,
                   const std::string& algo, int root, double timeout_s) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>((in.present ? in : out).stream);
  try {
    r.q->call(c, in, out, op, root, -1, algo, timeout_s, nullptr);
    GpuEvent ev(std::static_pointer_cast<GpuWork>(r.q), s, timeout_s);
    EXPECT(ev.wait(-1), "an event wait without a timeout returned false");
  } catch (...) {
    // The caller's buffers go out of scope next: let what was enqueued on them finish first (an
    // aborted call's steps end at once), as torch's record_stream keeps a tensor alive.
    cudaStreamSynchronize(s);
    throw;
  }
}

std::vector<std::string> run_world(int n, Tp tp, const std::function<void(Rank&)>& body,
                                   int64_t chunk_bytes, size_t staging, double timeout_s) {
  Shared shared;
  Barrier barrier(n);
  const nccl::UniqueId id = fake::nccl_world(n);
  std::vector<std::string> handles(static_cast<size_t>(n)), errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      Rank r{rank, n, nullptr, nullptr, &shared, &barrier};
      try {
        cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking);
        if (tp == Tp::nccl) {
          auto t = std::make_unique<NcclTransport>(fake::nccl_api(), id, rank, n, 0, chunk_bytes);
          r.q = std::make_shared<StreamQueue>(std::move(t), rank, n, 0, timeout_s, "",
                                              shared.peers());
        } else {
          auto t = std::make_unique<CudaIpcTransport>(rank, n, 0, staging);
          r.q = std::make_shared<StreamQueue>(std::move(t), rank, n, 0, timeout_s, "",
                                              shared.peers());
          handles[size_t(rank)] = r.q->handle();
          barrier.wait();
          r.q->open(handles);
          barrier.wait();
        }
        body(r);
      } catch (const std::exception& e) {
        errors[size_t(rank)] = std::string(e.what()).empty() ? "error" : e.what();
      }
      r.q.reset();  // the queue's destructor must not hang, whatever happened
      cudaStreamDestroy(r.stream);
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace host
