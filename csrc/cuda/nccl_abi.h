// The part of NCCL's C ABI plait calls, declared here so that building needs no nccl.h (the
// library is dlopen'ed at first use, see nccl_loader.h). These names and values are NCCL's stable
// ABI since 2.14; nccl_abi_check.cc compares them with a real nccl.h whenever the build finds one.
#pragma once
#include <cstddef>

#include <cuda_runtime_api.h>

namespace plait {
namespace nccl {

typedef struct ncclComm* Comm;
constexpr int kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};

enum Result : int {
  Success = 0,
  UnhandledCudaError = 1,
  SystemError = 2,
  InternalError = 3,
  InvalidArgument = 4,
  InvalidUsage = 5,
  RemoteError = 6,
  InProgress = 7,
  Timeout = 8
};
enum DataType : int {
  Int8 = 0,
  Uint8 = 1,
  Int32 = 2,
  Uint32 = 3,
  Int64 = 4,
  Uint64 = 5,
  Float16 = 6,
  Float32 = 7,
  Float64 = 8,
  Bfloat16 = 9
};
enum RedOp : int { Sum = 0, Prod = 1, Max = 2, Min = 3, Avg = 4 };

constexpr unsigned kApiMagic = 0xcafebeef;
// ncclConfig_t as of NCCL 2.14 (the first with non-blocking communicators). The struct is
// versioned and append-only: NCCL reads only the fields the stated version had.
struct Config {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char* netName;
};
constexpr unsigned kConfigVersion = 21400;  // NCCL_VERSION(2, 14, 0)
constexpr int kUndefInt = -2147483647 - 1;  // NCCL_CONFIG_UNDEF_INT

}  // namespace nccl
}  // namespace plait
