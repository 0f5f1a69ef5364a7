#include "transport/shared_mem.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core/errors.h"

namespace plait {
namespace {

struct Region {
  uint64_t id;
  int fd;
  size_t bytes;
};

// base address -> region, for shared_find's upper_bound lookup.
std::mutex g_mu;
std::map<uintptr_t, Region>& regions() {
  static auto* m = new std::map<uintptr_t, Region>;  // never destroyed: arrays may outlive statics
  return *m;
}
uint64_t g_next_id = 1;

std::string region_name(int32_t pid, uint64_t id) {
  return "plait-" + std::to_string(pid) + "-" + std::to_string(id);
}

}  // namespace

void* shared_alloc(size_t bytes, uint64_t* id) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t len = std::max<size_t>(page, (bytes + page - 1) / page * page);
  uint64_t my_id;
  {
    std::lock_guard<std::mutex> g(g_mu);
    my_id = g_next_id++;
  }
  const std::string name = region_name(int32_t(getpid()), my_id);
  const int fd = int(memfd_create(name.c_str(), MFD_CLOEXEC));
  if (fd < 0) throw PlaitError("plait.empty: memfd_create failed: " + std::string(strerror(errno)));
  if (ftruncate(fd, off_t(len)) != 0) {
    const int e = errno;
    close(fd);
    throw PlaitError("plait.empty: cannot size a shared buffer of " + std::to_string(len) +
                     " bytes: " + strerror(e));
  }
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    close(fd);
    throw PlaitError("plait.empty: cannot map a shared buffer of " + std::to_string(len) +
                     " bytes: " + strerror(e));
  }
  std::lock_guard<std::mutex> g(g_mu);
  regions()[reinterpret_cast<uintptr_t>(p)] = Region{my_id, fd, len};
  *id = my_id;
  return p;
}

void shared_free(uint64_t id) {
  std::lock_guard<std::mutex> g(g_mu);
  auto& m = regions();
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (it->second.id != id) continue;
    munmap(reinterpret_cast<void*>(it->first), it->second.bytes);
    close(it->second.fd);
    m.erase(it);
    return;
  }
}

size_t shared_region_count() {
  std::lock_guard<std::mutex> g(g_mu);
  return regions().size();
}

bool shared_find(const void* p, size_t bytes, RegionRef* out) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> g(g_mu);
  auto& m = regions();
  if (m.empty()) return false;
  auto it = m.upper_bound(a);  // first region starting after a
  if (it == m.begin()) return false;
  --it;
  if (a + bytes > it->first + it->second.bytes) return false;
  out->id = it->second.id;
  out->base = it->first;
  out->bytes = it->second.bytes;
  out->fd = it->second.fd;
  return true;
}

// ---------------------------------------------------------------------------------------------

PeerMappings::~PeerMappings() {
  while (!entries_.empty()) drop(entries_.size() - 1);
}

void PeerMappings::drop(size_t i) {
  munmap(entries_[i].local, entries_[i].bytes);
  entries_.erase(entries_.begin() + long(i));
}

char* PeerMappings::map(int32_t pid, const RegionRef& r) {
  ++clock_;
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    if (e.pid != pid) continue;
    if (e.id == r.id) {
      e.last_use = clock_;
      return e.local;
    }
    // An open fd number names one open file: the region we mapped under this number was closed
    // by its owner, so our mapping is all that keeps its memory alive.
    if (e.fd == r.fd) {
      drop(i);
      --i;
    }
  }
  // The link target names the memfd: check it is this region, not another file on a reused fd.
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(r.fd);
  char target[256];
  const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
  if (n <= 0) return nullptr;
  target[n] = 0;
  const std::string want = "/memfd:" + region_name(pid, r.id) + " ";  // then "(deleted)"
  if (std::strncmp(target, want.c_str(), want.size()) != 0) return nullptr;
  const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return nullptr;
  struct stat st;
  void* p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && uint64_t(st.st_size) >= r.bytes)
    p = mmap(nullptr, r.bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  if (entries_.size() >= kMaxEntries) {
    size_t old = 0;
    for (size_t i = 1; i < entries_.size(); ++i)
      if (entries_[i].last_use < entries_[old].last_use) old = i;
    drop(old);
  }
  entries_.push_back(Entry{pid, r.fd, r.id, r.bytes, clock_, static_cast<char*>(p)});
  return static_cast<char*>(p);
}

// ---------------------------------------------------------------------------------------------

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static void stream_avx512(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(s + i), b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128), e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  for (; i + 64 <= n; i += 64)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  _mm_sfence();
  if (i < n) std::memcpy(d + i, s + i, n - i);
}

__attribute__((target("avx2"))) static void stream_avx2(char* d, const char* s, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    for (size_t k = 0; k < 128; k += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + k)));
  }
  _mm_sfence();
  if (i < n) std::memcpy(d + i, s + i, n - i);
}
#endif

void stream_copy(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
#if defined(__x86_64__)
  // Non-temporal stores need an aligned destination: the head goes through memcpy.
  const size_t head = std::min(n, size_t(-reinterpret_cast<uintptr_t>(d) & 63));
  if (n - head >= 4096) {
    static const int isa = __builtin_cpu_supports("avx512f") ? 2
                           : __builtin_cpu_supports("avx2")  ? 1
                                                             : 0;
    if (isa) {
      std::memcpy(d, s, head);
      (isa == 2 ? stream_avx512 : stream_avx2)(d + head, s + head, n - head);
      return;
    }
  }
#endif
  std::memcpy(d, s, n);
}

void copy_out(void* dst, const void* src, size_t n) {
  if (n >= kStreamMin)
    stream_copy(dst, src, n);
  else
    std::memcpy(dst, src, n);
}

}  // namespace plait
