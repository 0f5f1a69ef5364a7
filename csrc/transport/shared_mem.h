// Shared buffers: memory plait allocates so that every rank on the host can map it.
//
// A user buffer in private memory can only reach a peer through the kernel (process_vm_readv:
// one copy, but it pins pages and, on this VM, streams at about half of memcpy's rate). A buffer
// from plait.empty() lives in a memfd: a peer opens /proc/<pid>/fd/<fd> once, maps it, and from
// then on reads and writes it with plain loads and stores (and non-temporal stores where nobody
// re-reads the data). No file is created in /dev/shm; the memory goes away with the last mapping.
//
// Regions are process-wide (one array may be used with any communicator). A region is named
// "plait-<pid>-<id>" with an id unique in the process, so a peer that finds a reused fd number
// behind an old mapping can tell.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace plait {

// What a rank publishes about the region holding a buffer (all zero: not in one).
struct RegionRef {
  uint64_t id = 0;    // unique in the owning process, never 0
  uint64_t base = 0;  // the region's address in the owner
  uint64_t bytes = 0;
  int32_t fd = -1;
  int32_t pad = 0;
};

// A new zero-filled region of at least `bytes` (rounded up to pages); throws PlaitError with the
// system's reason on failure. The pointer stays valid until shared_free(id).
void* shared_alloc(size_t bytes, uint64_t* id);
void shared_free(uint64_t id);
size_t shared_region_count();
// The region holding all of [p, p + bytes), or false.
bool shared_find(const void* p, size_t bytes, RegionRef* out);

// Peer regions mapped into this process. map() returns the local address of the peer's region
// (mapping it on first use; MAP_POPULATE so the faults are paid once), or nullptr when the peer's
// fd cannot be opened (other user, ptrace restrictions, the fd no longer that region).
class PeerMappings {
 public:
  PeerMappings() = default;
  PeerMappings(const PeerMappings&) = delete;
  PeerMappings& operator=(const PeerMappings&) = delete;
  ~PeerMappings();
  char* map(int32_t pid, const RegionRef& r);

 private:
  struct Entry {
    int32_t pid;
    int32_t fd;
    uint64_t id, bytes, last_use;
    char* local;
  };
  // Beyond this the least recently used mapping is unmapped. Generous: remapping a region costs an
  // open, an mmap and populating its page tables (milliseconds for tens of MiB).
  static constexpr size_t kMaxEntries = 128;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
  void drop(size_t i);
};

// Copies n bytes with non-temporal stores (the destination is not pulled into the cache, and
// not read for ownership first): for data this core will not touch again soon.
void stream_copy(void* dst, const void* src, size_t n);
// A copy into memory nobody here re-reads soon: streamed when it is too big to stay in cache
// anyway (kStreamMin and up), else memcpy, which leaves it cached for a caller reading it next.
// "Too big" is the last-level cache's business: on the 32 MiB-L3 AMD VM a 2-rank allgather over
// shared buffers took 27-35 us in place at 2 MiB with memcpy against 43-44 streamed (the old
// 512 KiB threshold, from the 2 MiB-L2 Intel VM); at 8 MiB the two were even, and at 32 MiB
// streaming won, 0.92-1.18 ms against 1.40-1.54 (2026-12-04).
constexpr size_t kStreamMin = size_t(4) << 20;
void copy_out(void* dst, const void* src, size_t n);

}  // namespace plait
