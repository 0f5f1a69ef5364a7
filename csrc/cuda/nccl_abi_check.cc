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
                  returns_result(&ncclBroadcast) && returns_result(&ncclReduce),
              "collective entry points");
static_assert(std::is_same<decltype(&ncclBroadcast),
                           ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, int,
                                            ncclComm_t, cudaStream_t)>::value &&
                  std::is_same<decltype(&ncclReduce),
                               ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t,
                                                ncclRedOp_t, int, ncclComm_t, cudaStream_t)>::value,
              "ncclBroadcast / ncclReduce signatures");
