// What an algorithm gets to work with, and the one ordered table of algorithms for every device.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "core/call.h"
#include "core/types.h"
#include "reduce/reduce.h"
#include "transport/table.h"
#include "transport/transport.h"

namespace plait {

// The view an algorithm runs in: a transport, the call, and the reduction bound to its dtype/op.
struct Ctx {
  Transport& tp;
  const CallArgs& a;
  size_t esize;
  size_t psize;  // bytes of one partial (reduce.h): 4 for the half types, else esize
  int rank, size;

  Ctx(Transport& t, const CallArgs& args)
      : tp(t),
        a(args),
        esize(dtype_size(args.dtype)),
        psize(partial_size(args.dtype)),
        rank(t.rank()),
        size(t.size()) {}

  const char* in_at(int64_t elem) const { return static_cast<const char*>(a.in) + elem * esize; }
  char* out_at(int64_t elem) const { return static_cast<char*>(a.out) + elem * esize; }
  // Reduces n sources into dst; `final` applies avg's division (only the step that produces the
  // finished value may pass it, so every rank ends with the same bytes).
  // Multi-hop algorithms mark which sources hold partials (bit j: srcs[j]) and whether dst gets
  // them, so that half types carry float32 between hops and round only in the finishing step.
  void reduce(void* dst, const void* const* srcs, int n, int64_t count, bool final,
              uint32_t partial_srcs = 0, bool partial_dst = false) const {
    plait::reduce(a.dtype, a.op, dst, srcs, n, size_t(count), final ? size : 0, partial_srcs,
                  partial_dst);
  }
  // Whether `bytes` (> 0) can travel inline on the post line (Transport::inline_slot): tiny
  // calls then need no staging copy and one cache-line transfer per peer.
  bool fits_inline(size_t bytes) const { return bytes && bytes <= tp.inline_bytes(); }
  // Elements that fit in `bytes` at `unit` bytes each (default esize; psize for staging that
  // holds partials), rounded down to whole 64-byte lines where possible.
  int64_t elems_in(size_t bytes, size_t unit = 0) const {
    unit = unit ? unit : esize;
    size_t e = bytes / unit;
    size_t line = 64 / unit ? 64 / unit : 1;
    return int64_t(e >= line ? e - e % line : e);
  }
};

// The staging area cut into `count` pipeline slots used round-robin by 1-based step number:
// step s writes slot (s-1) % count, and may do so once its readers acked step s - count.
struct Slots {
  Slots(Transport& tp, int count)
      : tp_(tp), count_(count), bytes(tp.staging_bytes() / size_t(count)) {}
  size_t offset(int64_t step) const { return size_t((step - 1) % count_) * bytes; }
  char* at(int rank, int64_t step) const { return tp_.staging(rank) + offset(step); }
  int count() const { return count_; }

 private:
  Transport& tp_;
  int count_;

 public:
  const size_t bytes;
};

// The views a GPU algorithm runs in (algo/gpu_algo.h, CUDA builds only).
struct GpuCtx;
struct IpcCtx;

// How a row runs: on the host over a Transport, or enqueued on a CUDA stream over NCCL or over
// CUDA IPC. The kind follows from the capabilities a row needs (host_staging: host; nccl_*: gpu;
// cuda_ipc: ipc); the communicator of that transport calls the matching member.
struct Runner {
  enum Kind : uint8_t { host, gpu, ipc } kind;
  union {
    void (*on_host)(Ctx&);
    void (*on_gpu)(GpuCtx&);
    void (*on_ipc)(IpcCtx&);
  };
  Runner(void (*f)(Ctx&)) : kind(host), on_host(f) {}
  Runner(void (*f)(GpuCtx&)) : kind(gpu), on_gpu(f) {}
  Runner(void (*f)(IpcCtx&)) : kind(ipc), on_ipc(f) {}
};

struct Algorithm {
  Coll coll;
  const char* name;  // unique among the rows one transport is offered for a collective
  Caps needs;        // what the transport must offer (transport/table.h)
  Runner run;
};

// The one table, in the order plait.algorithms() reports. GPU rows are compiled in CUDA builds
// only (their bodies need CUDA); a CPU-only build has none, and no GPU transport connects there.
const std::vector<Algorithm>& algorithm_table();
// The rows of collective c whose needs `offered` covers, in table order: a transport's offered
// rows (transport_caps) are the names it accepts, and an index into them is what calls carry
// (CallArgs::algo, fingerprints, flight records).
const std::vector<const Algorithm*>& algorithms_for(Coll c, Caps offered);
// The index of `name` in algorithms_for(c, offered); -1 if there is none.
int algorithm_index(Coll c, Caps offered, const std::string& name);
// The index in algorithm_table() of the first row named `name` (any collective); -1 if none.
int algorithm_row(const std::string& name);

// What "auto" decides by, for one call: the capabilities the transport has now (a shm
// communicator without cross-process reads lacks peer_read) and the call's shape.
struct AutoInputs {
  Caps caps = 0;
  size_t bytes = 0;  // of the call's vector, as CallArgs::count counts it
  int world = 1;
  size_t staging_bytes = 0;
  bool oversubscribed = false;
};
// The algorithm name "auto" picks for this call, among rows whose needs `in.caps` covers.
// Deterministic in its inputs, so that every rank picks the same one.
const char* auto_algorithm(Coll c, const AutoInputs& in);

// An algorithm override (PLAIT_ALGO for host calls, PLAIT_GPU_ALGO over NCCL): "ring" (every
// collective with a row of that name among `offered`'s), or "allreduce=tree,allgather=direct".
// strict: an item that names no row of `offered` is an InvalidArgument now (a host
// communicator refuses it at init); otherwise a "collective=name" item is kept, and the call
// that would run it is refused.
struct AlgoOverride {
  std::string text;
  std::vector<std::string> forced;  // per collective; "" = auto
  AlgoOverride() : forced(size_t(Coll::kCount)) {}
  AlgoOverride(const std::string& text, Caps offered, bool strict, const char* env_name);
};

// The one selector: the index in algorithms_for(c, offered) of the row a call runs (`asked`:
// "auto", "" or a name; auto takes the override's choice, else auto_algorithm(c, in)), or -1
// with *why saying what is wrong, starting "rank R: collective". A row whose needs the live
// capabilities (in.caps) lack is refused with `unavailable` as the reason.
int select_algorithm(Coll c, const std::string& asked, const AlgoOverride& ov, Caps offered,
                     const AutoInputs& in, int rank, const std::string& unavailable,
                     std::string* why);

// Private scratch memory of this thread, at least `bytes`, 64-byte aligned; reused by later
// calls on the same thread (so it grows to the largest request and stays).
inline char* scratch(size_t bytes) {
  struct Buf {
    char* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf b;
  if (b.n < bytes) {
    std::free(b.p);
    b.n = (bytes + 63) / 64 * 64;
    b.p = static_cast<char*>(std::aligned_alloc(64, b.n));
    if (!b.p) {
      b.n = 0;
      throw std::bad_alloc();
    }
  }
  return b.p;
}

// Chunk of the single-copy reductions: peers' pieces are read into scratch that stays in L2.
// allreduce also keeps the reduced chunk there until it is pushed to the peers, so scratch and
// output chunk together must fit L2 with room to spare: on the 2 MiB-L2 VM a 2-rank in-place
// 64 MiB allreduce took 12.4 ms with 1 MiB, 8.2-10.0 ms with 128-512 KiB (256 KiB best).
constexpr size_t kSingleCopyScratch = size_t(256) << 10;
// Out-of-place single-copy allreduce outputs at least this large, where a peer maps them (plait
// shared buffers), are written with non-temporal stores.
constexpr size_t kStreamOutMin = size_t(8) << 20;
// allgather's copy of its own block (out of place) streams when the gathered output is at least
// this large: below it, memcpy's cached copy was faster on the 32 MiB-L3 VM (2-rank 2 MiB out of
// place 112-117 us vs 159-168 us streamed; 8 MiB even), above it streaming (16 MiB 1.85-2.27 vs
// 2.23-2.47 ms; 64 MiB 5.5-5.9 vs 7.0-7.4 ms).
constexpr size_t kGatherStreamMin = size_t(8) << 20;

// From this many bytes "shared_or_staged" allreduce falls back to "staged_parts" rather than the
// ring: on the AMD EPYC VM, 2 ranks, private buffers, in one interleaved job (2026-12-05,
// RESULTS.md) staged_parts ran 256 KiB-4 MiB 5-20% faster than the ring (4 MiB in place 291-307 vs
// 329-346 us, out of place 472 vs 511-568; plait-bench 1 MiB 62 vs 75 us, 2 MiB 125 vs 153);
// below 256 KiB the two were within noise.
constexpr size_t kStagedPartsMin = size_t(256) << 10;

// The single-copy reductions' inner step: reads `len` elements at byte offset `off` of every
// peer's input (Transport::read_peer) into scratch `tmp` (n-1 slots of `stride` bytes) and
// reduces them with this rank's `own` elements, in rank order, into dst. Peers are read in an
// order rotated by rank so that no rank is read by all the others at once.
inline void reduce_from_peers(Ctx& c, void* dst, const void* own, size_t off, int64_t len,
                              char* tmp, size_t stride, std::vector<const void*>& src) {
  int slot = 0;
  for (int i = 0; i < c.size; ++i) {
    const int p = (c.rank + i) % c.size;
    if (p == c.rank) {
      src[size_t(p)] = own;
      continue;
    }
    const char* theirs = c.tp.peer_in(p) + off;
    if (const char* mapped = c.tp.peer_local(p, theirs, size_t(len) * c.esize)) {
      src[size_t(p)] = mapped;  // a plait shared buffer: reduced straight from the peer's memory
      continue;
    }
    char* t = tmp + size_t(slot++) * stride;
    c.tp.read_peer(p, t, theirs, size_t(len) * c.esize);
    src[size_t(p)] = t;
  }
  c.reduce(dst, src.data(), c.size, len, true);
}

// Reduces elements [first, first + count) of every rank's input, in rank order, into dst, reading
// peers' pieces straight from their inputs in L2-sized chunks. Peers must have exposed their
// addresses (Transport::expose + a channel-0 post at step 1); this waits for that first.
inline void reduce_range_from_peers(Ctx& c, char* dst, int64_t first, int64_t count) {
  const int64_t chunk = std::max<int64_t>(1, c.elems_in(kSingleCopyScratch / size_t(c.size - 1)));
  char* tmp = scratch(size_t(c.size - 1) * size_t(chunk) * c.esize);
  std::vector<const void*> src(static_cast<size_t>(c.size));
  for (int p = 0; p < c.size; ++p)
    if (p != c.rank) c.tp.wait_post(p, 0, 1);
  for (int64_t lo = 0; lo < count; lo += chunk) {
    const int64_t len = std::min(chunk, count - lo);
    reduce_from_peers(c, dst + size_t(lo) * c.esize, c.in_at(first + lo),
                      size_t(first + lo) * c.esize, len, tmp, size_t(chunk) * c.esize, src);
  }
}

// Parts of algorithms that shared_or_staged runs too (each defined in its algorithm's file).
// allreduce "ring" numbering its steps from first_step + 1 (0: a call of its own).
void allreduce_ring_steps(Ctx& c, int64_t first_step);
// allreduce "staged_parts" numbering its channel-0 steps from first_step + 1 (0: a call of its
// own); its channel-1 steps count from 1.
void allreduce_staged_parts_rounds(Ctx& c, int64_t first_step);
// allgather "direct" numbering its rounds from first_round + 1 (0: a call of its own).
void allgather_direct_rounds(Ctx& c, int64_t first_round);
// The single-copy algorithms once this rank has exposed its buffers and posted channel-0 step 1.
void allreduce_single_copy_exposed(Ctx& c);
void allgather_single_copy_exposed(Ctx& c);

// [begin, end) of part q when n elements are split into `parts` near-equal parts.
inline int64_t part_begin(int64_t n, int parts, int q) { return n * q / parts; }

}  // namespace plait
