#include "cuda/nccl_loader.h"

#include <dlfcn.h>

#include <memory>
#include <mutex>

#include "core/errors.h"

namespace plait {
namespace {

std::mutex g_mu;
std::unique_ptr<NcclApi> g_api;

template <class F>
void resolve(void* lib, const char* name, F** fn, const std::string& path) {
  *fn = reinterpret_cast<F*>(dlsym(lib, name));
  if (!*fn)
    throw PlaitError("NCCL at '" + path + "' lacks " + name + " (plait needs NCCL >= 2.14)");
}

}  // namespace

const NcclApi& nccl_load(const std::string& path) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_api) return *g_api;
  const std::string name = path.empty() ? "libnccl.so.2" : path;
  // RTLD_LOCAL: NCCL's symbols stay private to plait, so a torch that bundles another NCCL in the
  // same process keeps its own.
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    throw PlaitError("cannot load NCCL from '" + name + "': " + (err ? err : "unknown error") +
                     " (pip install nvidia-nccl-cu13, or put libnccl.so.2 on the loader path)");
  }
  auto api = std::make_unique<NcclApi>();
  resolve(lib, "ncclGetVersion", &api->GetVersion, name);
  resolve(lib, "ncclGetUniqueId", &api->GetUniqueId, name);
  resolve(lib, "ncclCommInitRankConfig", &api->CommInitRankConfig, name);
  resolve(lib, "ncclCommFinalize", &api->CommFinalize, name);
  resolve(lib, "ncclCommDestroy", &api->CommDestroy, name);
  resolve(lib, "ncclCommAbort", &api->CommAbort, name);
  resolve(lib, "ncclCommGetAsyncError", &api->CommGetAsyncError, name);
  resolve(lib, "ncclGetErrorString", &api->GetErrorString, name);
  resolve(lib, "ncclGetLastError", &api->GetLastError, name);
  resolve(lib, "ncclAllReduce", &api->AllReduce, name);
  resolve(lib, "ncclReduceScatter", &api->ReduceScatter, name);
  resolve(lib, "ncclAllGather", &api->AllGather, name);
  resolve(lib, "ncclBroadcast", &api->Broadcast, name);
  resolve(lib, "ncclReduce", &api->Reduce, name);
  resolve(lib, "ncclSend", &api->Send, name);
  resolve(lib, "ncclRecv", &api->Recv, name);
  resolve(lib, "ncclGroupStart", &api->GroupStart, name);
  resolve(lib, "ncclGroupEnd", &api->GroupEnd, name);
  int v = 0;
  if (api->GetVersion(&v) != nccl::Success)
    throw PlaitError("ncclGetVersion failed for '" + name + "'");
  if (v < 21400)
    throw PlaitError("NCCL at '" + name + "' is version " + std::to_string(v) +
                     "; plait needs >= 2.14");
  api->version = v;
  api->path = name;
  g_api = std::move(api);  // the library stays loaded for the life of the process
  return *g_api;
}

const NcclApi* nccl_loaded() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_api.get();
}

}  // namespace plait
