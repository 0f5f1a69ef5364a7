// The one validator: every call, host or GPU, is checked here before anything is selected or run.
#include <cstdint>
#include <memory>
#include <sstream>

#include "core/call.h"

namespace plait {

namespace {
std::string where(const Buffer& b) {
  return b.device == Device::cpu ? std::string("host memory")
                                 : "GPU " + std::to_string(b.device_index);
}
}  // namespace

std::string validate_call(Coll c, const Buffer& in, const Buffer& out, RedOp op, int root, int peer,
                          int64_t tag, double timeout_s, int rank, int size, bool any_source,
                          CallArgs* ap) {
  CallArgs& a = *ap;
  a = CallArgs{};
  a.coll = c;
  a.op = op;
  a.root = root;
  a.peer = peer;
  a.tag = tag;
  a.timeout_s = timeout_s;
  const Buffer& first = in.present ? in : out;
  a.dtype = first.dtype;
  const size_t es = dtype_size(a.dtype);
  // Built only when something is wrong: a stream per call would cost more than the call.
  std::unique_ptr<std::ostringstream> why;
  auto bad = [&]() -> std::ostream& {
    if (!why) {
      why.reset(new std::ostringstream);
      *why << "rank " << rank << ": " << coll_name(c) << ": ";
    } else {
      *why << "; ";
    }
    return *why;
  };
  auto check_buf = [&](const Buffer& b, const char* name, bool write) {
    if (!b.present) return;
    if (b.device != first.device || b.device_index != first.device_index)
      bad() << name << " is in " << where(b) << ", input in " << where(first)
            << " (pass both in the same memory)";
    if (!b.contiguous) bad() << name << " is not contiguous (pass a C-contiguous array)";
    if (write && !b.writable) bad() << name << " is read-only";
    if (b.dtype != a.dtype)
      bad() << name << " has dtype " << dtype_name(b.dtype) << " but input has "
            << dtype_name(a.dtype);
    if (b.bytes % es)
      bad() << name << " has " << b.bytes << " bytes, not a whole number of elements";
    // A GPU kernel reading a misaligned T* faults with a sticky error that kills the process's
    // CUDA context (torch's too), so such views (a cupy MemoryPointer at an odd offset, a
    // __cuda_array_interface__ object) are refused here, before any launch. Host kernels cope.
    if (b.device == Device::cuda && reinterpret_cast<uintptr_t>(b.ptr) % es)
      bad() << name << " at address 0x" << std::hex << reinterpret_cast<uintptr_t>(b.ptr)
            << std::dec << " is not aligned to its " << es << "-byte " << dtype_name(b.dtype)
            << " elements (pass an aligned view)";
  };
  auto overlap = [](const Buffer& x, const Buffer& y) {
    auto xs = static_cast<const char*>(x.ptr), ys = static_cast<const char*>(y.ptr);
    return x.bytes && y.bytes && xs < ys + y.bytes && ys < xs + x.bytes;
  };
  const bool is_root = root == rank;
  const bool needs_out = c != Coll::barrier && c != Coll::send && !(c == Coll::reduce && !is_root);
  check_buf(in, "input", false);
  check_buf(out, "output", true);
  if (needs_out && !out.present) bad() << "an output buffer is required";
  if (c == Coll::send && !in.present) bad() << "send needs an input buffer";
  if ((c == Coll::broadcast || c == Coll::reduce) && (root < 0 || root >= size))
    bad() << "root " << root << " is out of range for " << size << " ranks";
  if ((c == Coll::send || c == Coll::recv) && (peer < 0 || peer >= size || peer == rank) &&
      !(c == Coll::recv && peer == kAnySource && any_source))
    bad() << "peer " << peer << " is not another rank of this " << size << "-rank communicator";
  if (op == RedOp::avg && !is_float(a.dtype))
    bad() << "op avg needs a floating-point dtype, got " << dtype_name(a.dtype);
  if (unsigned(op) >= unsigned(RedOp::kCount)) bad() << "unknown reduction op";
  // Never "no deadline" for a value that is no deadline at all: NaN compares false everywhere.
  if (!(a.timeout_s >= 0)) {
    bad() << "timeout must be a number of seconds >= 0 (0 fails at once if a peer is not "
             "there), got "
          << a.timeout_s;
  }
  const size_t inb = in.present ? in.bytes : 0, outb = out.present ? out.bytes : 0;
  const size_t n = size_t(size);
  auto same_or_apart = [&](const Buffer& x, const Buffer& y, const void* allowed,
                           const char* what) {
    if (x.present && y.present && overlap(x, y) && x.ptr != allowed)
      bad() << "input and output overlap (" << what << ")";
  };
  switch (c) {
    case Coll::allreduce:
    case Coll::broadcast:
      if (out.present && outb != inb) bad() << "output has " << outb << " bytes, input " << inb;
      same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr,
                    "only out is x is allowed");
      a.count = int64_t(inb / es);
      break;
    case Coll::reduce:
      if (is_root && out.present && outb != inb)
        bad() << "output has " << outb << " bytes, input " << inb;
      if (is_root)
        same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr,
                      "only out is x is allowed");
      a.count = int64_t(inb / es);
      break;
    case Coll::reduce_scatter:
      if (inb != n * outb)
        bad() << "input has " << inb << " bytes but must be " << size << " x the output's " << outb;
      same_or_apart(out, in, static_cast<const char*>(in.ptr) + size_t(rank) * outb,
                    "in place means output is this rank's block of the input");
      a.count = int64_t(outb / es);
      break;
    case Coll::allgather:
      if (outb != n * inb)
        bad() << "output has " << outb << " bytes but must be " << size << " x the input's " << inb;
      same_or_apart(in, out, static_cast<const char*>(out.ptr) + size_t(rank) * inb,
                    "in place means input is this rank's block of the output");
      a.count = int64_t(inb / es);
      break;
    case Coll::alltoall:
      if (inb % (n * es)) bad() << "input has " << inb << " bytes, not " << size << " equal blocks";
      if (outb != inb) bad() << "output has " << outb << " bytes, input " << inb;
      same_or_apart(in, out, out.ptr == in.ptr && outb == inb ? in.ptr : nullptr,
                    "only out is x is allowed");
      a.count = int64_t(inb / (n * es));
      break;
    case Coll::send:
      a.count = int64_t(inb / es);
      break;
    case Coll::recv:
      a.count = int64_t(outb / es);
      break;
    case Coll::barrier:
    case Coll::kCount:
      break;
  }
  a.in = in.present ? in.ptr : nullptr;
  a.out = out.present ? out.ptr : nullptr;
  return why ? why->str() : std::string();
}

}  // namespace plait
