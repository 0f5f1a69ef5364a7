// Compiled only when the build finds a real nccl.h: proves nccl_abi.h's declarations match it.
#include <nccl.h>

#include <cstddef>
#include <type_traits>

#include "cuda/nccl_abi.h"

namespace n = plait::nccl;

static_assert(sizeof(n::UniqueId) == sizeof(ncclUniqueId), "ncclUniqueId size");
static_assert(int(n::InProgress) == int(ncclInProgress) &&
                  int(n::RemoteError) == int(ncclRemoteError) &&
                  int(n::Timeout) == int(ncclTimeout) &&
                  int(n::InvalidUsage) == int(ncclInvalidUsage),
              "ncclResult_t values");
static_assert(int(n::Int8) == int(ncclInt8) && int(n::Uint8) == int(ncclUint8) &&
                  int(n::Int32) == int(ncclInt32) && int(n::Int64) == int(ncclInt64) &&
                  int(n::Float16) == int(ncclFloat16) && int(n::Float32) == int(ncclFloat32) &&
                  int(n::Float64) == int(ncclFloat64) && int(n::Bfloat16) == int(ncclBfloat16),
              "ncclDataType_t values");
static_assert(int(n::Sum) == int(ncclSum) && int(n::Prod) == int(ncclProd) &&
                  int(n::Max) == int(ncclMax) && int(n::Min) == int(ncclMin) &&
                  int(n::Avg) == int(ncclAvg),
              "ncclRedOp_t values");
static_assert(n::kApiMagic == NCCL_API_MAGIC && n::kUndefInt == NCCL_CONFIG_UNDEF_INT,
              "config constants");
static_assert(offsetof(n::Config, blocking) == offsetof(ncclConfig_t, blocking) &&
                  offsetof(n::Config, netName) == offsetof(ncclConfig_t, netName),
              "ncclConfig_t prefix layout");
// Every value, every field of the 2.14 prefix, and its end: NCCL reads `size` bytes of the
// config, so plait's struct must stop exactly where 2.14's did (at splitShare).
static_assert(int(n::Success) == int(ncclSuccess) &&
                  int(n::UnhandledCudaError) == int(ncclUnhandledCudaError) &&
                  int(n::SystemError) == int(ncclSystemError) &&
                  int(n::InternalError) == int(ncclInternalError) &&
                  int(n::InvalidArgument) == int(ncclInvalidArgument),
              "ncclResult_t values (the rest)");
static_assert(int(n::Uint32) == int(ncclUint32) && int(n::Uint64) == int(ncclUint64),
              "ncclDataType_t unsigned values");
static_assert(sizeof(n::Config) == offsetof(ncclConfig_t, splitShare), "the 2.14 config's end");
static_assert(offsetof(n::Config, size) == offsetof(ncclConfig_t, size) &&
                  offsetof(n::Config, magic) == offsetof(ncclConfig_t, magic) &&
                  offsetof(n::Config, version) == offsetof(ncclConfig_t, version) &&
                  offsetof(n::Config, cgaClusterSize) == offsetof(ncclConfig_t, cgaClusterSize) &&
                  offsetof(n::Config, minCTAs) == offsetof(ncclConfig_t, minCTAs) &&
                  offsetof(n::Config, maxCTAs) == offsetof(ncclConfig_t, maxCTAs),
              "ncclConfig_t field offsets");
static_assert(n::kConfigVersion == NCCL_VERSION(2, 14, 0), "the config version plait states");
static_assert(sizeof(n::Result) == sizeof(ncclResult_t) &&
                  sizeof(n::DataType) == sizeof(ncclDataType_t) &&
                  sizeof(n::RedOp) == sizeof(ncclRedOp_t),
              "enums travel as int");

// The entry points nccl_loader.h declares: same result and parameter count as nccl.h (the handle
// type is plait's own incomplete struct, so the signatures cannot be compared whole).
template <class R, class... A>
constexpr int arity(R (*)(A...)) {
  return int(sizeof...(A));
}
template <class R, class... A>
constexpr bool returns_result(R (*)(A...)) {
  return std::is_same<R, ncclResult_t>::value;
}
static_assert(arity(&ncclAllReduce) == 7 && arity(&ncclReduceScatter) == 7 &&
                  arity(&ncclAllGather) == 6 && arity(&ncclBroadcast) == 7 &&
                  arity(&ncclReduce) == 8 && arity(&ncclSend) == 6 && arity(&ncclRecv) == 6 &&
                  arity(&ncclCommFinalize) == 1 && returns_result(&ncclCommFinalize) &&
                  returns_result(&ncclBroadcast) && returns_result(&ncclReduce),
              "collective entry points");
static_assert(std::is_same<decltype(&ncclBroadcast),
                           ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, int,
                                            ncclComm_t, cudaStream_t)>::value &&
                  std::is_same<decltype(&ncclReduce),
                               ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t,
                                                ncclRedOp_t, int, ncclComm_t, cudaStream_t)>::value,
              "ncclBroadcast / ncclReduce signatures");
