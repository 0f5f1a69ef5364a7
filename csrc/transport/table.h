// The ordered table of transports, NCCL's way: each entry says what it offers an algorithm (its
// capabilities) and whether it can connect the ranks of a call with these buffers; the first
// entry that can connect carries the call. An algorithm's row (algo/algo.h) names the
// capabilities it needs, so a transport is offered exactly the rows it can run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace plait {

using Caps = uint32_t;
enum Cap : Caps {
  kCapHostStaging = 1u << 0,  // host staging every rank loads and stores, with step flags (shm)
  kCapPeerRead = 1u << 1,     // reads peers' buffers directly: single copy (shm with CMA or
                              // plait's shared buffers; a communicator may lack it at run time)
  kCapCudaIpc = 1u << 2,      // peers' GPU staging mapped over CUDA IPC, flags on the stream
  kCapNcclP2p = 1u << 3,      // NCCL send/recv on the caller's stream
  kCapNcclColl = 1u << 4,     // NCCL's own collectives
  kCapAll = (1u << 5) - 1,
};
// What each transport offers (its entry in the table below carries the same).
constexpr Caps kShmCaps = kCapHostStaging | kCapPeerRead;
constexpr Caps kIpcCaps = kCapCudaIpc;
constexpr Caps kNcclCaps = kCapNcclP2p | kCapNcclColl;
// The capabilities' names, bit by bit (bit i: kCapNames[i]), as Python sees them.
constexpr const char* kCapNames[] = {"host_staging", "peer_read", "cuda_ipc", "nccl_p2p",
                                     "nccl_collectives"};
constexpr int kCapCount = sizeof(kCapNames) / sizeof(kCapNames[0]);

// What a transport must know of a call to say whether it can connect its ranks.
struct TransportProbe {
  bool device_buffers = false;  // the buffers are CUDA device memory (else host memory)
  bool one_host = true;         // every rank of the communicator is on this host
  bool shared_gpu = false;      // two ranks' buffers are on one GPU (NCCL refuses that)
  bool nccl_loaded = true;      // every rank loaded NCCL
  std::string prefer = "auto";  // PLAIT_GPU_TRANSPORT: "auto", or the one GPU transport allowed
};

struct TransportKind {
  const char* name;  // as PLAIT_GPU_TRANSPORT, the flight recorder and the call check name it
  Caps caps;
  bool built;  // compiled into this build (the GPU transports only with PLAIT_CUDA)
  bool (*can_connect)(const TransportProbe&);
};

// shm, ipc (CUDA IPC), nccl: in that order in every build; entries not built never connect.
const std::vector<TransportKind>& transport_table();
// The first entry that can connect the probe's ranks; nullptr when none can.
const TransportKind* select_transport(const TransportProbe& p);
// The entry of that name; nullptr when there is none.
const TransportKind* transport_named(const std::string& name);
// The capabilities of the entry of that name; InvalidArgument if there is none.
Caps transport_caps(const std::string& name);

}  // namespace plait
