// The ordered transport table. Host buffers of ranks on one host go over shared memory. GPU
// buffers go over CUDA IPC where two ranks share a GPU (NCCL refuses that) or where
// PLAIT_GPU_TRANSPORT=ipc asks for it, within one host; everywhere else over NCCL, which also
// crosses hosts. IPC is probed before NCCL so that a shared GPU never reaches NCCL.
#include "transport/table.h"

#include <cstring>

#include "core/errors.h"

namespace plait {

namespace {
bool shm_connects(const TransportProbe& p) { return !p.device_buffers && p.one_host; }

bool ipc_connects(const TransportProbe& p) {
  return PLAIT_WITH_CUDA && p.device_buffers && p.one_host &&
         (p.prefer == "ipc" || (p.prefer == "auto" && p.shared_gpu));
}

bool nccl_connects(const TransportProbe& p) {
  return PLAIT_WITH_CUDA && p.device_buffers && (p.prefer == "auto" || p.prefer == "nccl") &&
         !p.shared_gpu && p.nccl_loaded;
}
}  // namespace

const std::vector<TransportKind>& transport_table() {
  static const std::vector<TransportKind> table = {
      {"shm", kShmCaps, true, shm_connects},
      {"ipc", kIpcCaps, bool(PLAIT_WITH_CUDA), ipc_connects},
      {"nccl", kNcclCaps, bool(PLAIT_WITH_CUDA), nccl_connects},
  };
  return table;
}

const TransportKind* select_transport(const TransportProbe& p) {
  for (const TransportKind& t : transport_table())
    if (t.built && t.can_connect(p)) return &t;
  return nullptr;
}

const TransportKind* transport_named(const std::string& name) {
  for (const TransportKind& t : transport_table())
    if (name == t.name) return &t;
  return nullptr;
}

Caps transport_caps(const std::string& name) {
  if (const TransportKind* t = transport_named(name)) return t->caps;
  std::string names;
  for (const TransportKind& t : transport_table())
    names += (names.empty() ? "" : ", ") + std::string(t.name);
  throw InvalidArgument("unknown transport '" + name + "' (" + names + ")");
}

}  // namespace plait
