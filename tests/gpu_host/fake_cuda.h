// A fake CUDA runtime for host tests of plait's GPU path: the cudart entry points plait calls,
// defined over host memory and host threads, so the unchanged stream queue, transports and GPU
// algorithms run on a CPU. Each stream is an executor thread running its work in FIFO order
// (cudaStreamPerThread: one per issuing thread; 0 and cudaStreamLegacy: one for the process), so
// enqueueing returns at once and events complete when the stream reaches them, as on a GPU.
// Device memory is host memory. Graph capture follows CUDA's rule that matters to plait: while a
// thread captures in global mode, cudaEventQuery from any thread in global mode fails with
// cudaErrorStreamCaptureUnsupported and invalidates the capture.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fake {

// Runs `work` on stream s in order (a kernel). Waits inside must end by themselves.
void launch(cudaStream_t s, std::function<void()> work);
// A kernel that waits until *gate is true (torch.cuda._sleep with a release).
void gate(cudaStream_t s, const std::atomic<bool>* gate);
// Every wait of a fake stream or event gives up after this many seconds (a broken test must not
// hang CI); a give-up is counted.
constexpr double kHangS = 30;
int hangs();

struct Counters {
  std::atomic<int> events_created{0}, event_queries{0}, capture_refusals{0}, mallocs{0};
};
Counters& counters();
// The (stream, event) pairs of cudaStreamWaitEvent, in call order (for ordering checks).
std::vector<std::pair<cudaStream_t, cudaEvent_t>> stream_waits();
void clear_log();
// The next n cudaMalloc calls fail with cudaErrorMemoryAllocation.
void fail_mallocs(int n);
// Kernels sleep a random 0..us microseconds first (fake_kernels.cc), to shake interleavings.
void set_jitter_us(int us);
void jitter();

}  // namespace fake
