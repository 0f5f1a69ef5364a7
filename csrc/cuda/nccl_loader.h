// NCCL loaded with dlopen at first use, so the module imports on machines without NCCL or a GPU.
// Python passes the path of libnccl.so.2 (from the nvidia-nccl-cu13 wheel) or "" for the system
// loader path; the first successful load wins for the life of the process.
#pragma once
#include <string>

#include "cuda/nccl_abi.h"

namespace plait {

struct NcclApi {
  nccl::Result (*GetVersion)(int*);
  nccl::Result (*GetUniqueId)(nccl::UniqueId*);
  nccl::Result (*CommInitRankConfig)(nccl::Comm*, int, nccl::UniqueId, int, nccl::Config*);
  nccl::Result (*CommFinalize)(nccl::Comm);  // 2.14+: flushes a non-blocking communicator
  nccl::Result (*CommDestroy)(nccl::Comm);
  nccl::Result (*CommAbort)(nccl::Comm);
  nccl::Result (*CommGetAsyncError)(nccl::Comm, nccl::Result*);
  const char* (*GetErrorString)(nccl::Result);
  const char* (*GetLastError)(nccl::Comm);
  nccl::Result (*AllReduce)(const void*, void*, size_t, nccl::DataType, nccl::RedOp, nccl::Comm,
                            cudaStream_t);
  nccl::Result (*ReduceScatter)(const void*, void*, size_t, nccl::DataType, nccl::RedOp, nccl::Comm,
                                cudaStream_t);
  nccl::Result (*AllGather)(const void*, void*, size_t, nccl::DataType, nccl::Comm, cudaStream_t);
  nccl::Result (*Broadcast)(const void*, void*, size_t, nccl::DataType, int, nccl::Comm,
                            cudaStream_t);
  nccl::Result (*Reduce)(const void*, void*, size_t, nccl::DataType, nccl::RedOp, int, nccl::Comm,
                         cudaStream_t);
  nccl::Result (*Send)(const void*, size_t, nccl::DataType, int, nccl::Comm, cudaStream_t);
  nccl::Result (*Recv)(void*, size_t, nccl::DataType, int, nccl::Comm, cudaStream_t);
  nccl::Result (*GroupStart)();
  nccl::Result (*GroupEnd)();
  int version;       // e.g. 23203 for 2.32.3
  std::string path;  // what was loaded
};

// Loads NCCL (once) and returns its entry points; throws PlaitError naming the path and the
// dlopen/dlsym error when it cannot.
const NcclApi& nccl_load(const std::string& path);
// The loaded API, or null when nccl_load has not succeeded yet.
const NcclApi* nccl_loaded();

}  // namespace plait
