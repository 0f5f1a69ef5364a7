#include "transport/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstring>
#include <sstream>

namespace plait {
namespace {

constexpr uint64_t kMagic = 0x474553544941504cull;  // "PLAITSEG"
constexpr uint32_t kVersion = 6;
constexpr uint32_t kWriting = 0xffffffffu;
constexpr size_t kPage = 4096;
constexpr size_t kPairHeader = 64;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

std::string errno_text(int e) { return std::string(strerror(e)); }

// The word rank r keeps at RankCtl::probe_addr for peers to read.
uint64_t probe_value(const SegHeader* h, int rank) {
  return h->token[0] ^ (0x9e3779b97f4a7c15ull * uint64_t(rank + 1));
}

size_t flight_bytes(int n, uint32_t slots) {
  return slots ? round_up(size_t(n) * (size_t(slots) + 1) * 64, kPage) : 0;
}

size_t gpu_print_bytes(int n) { return round_up(size_t(n) * kGpuPrints * sizeof(GpuPrint), kPage); }

}  // namespace

size_t Segment::bytes_needed(int n, size_t staging, size_t pair_slot, uint32_t flight_slots) {
  size_t b = kPage;
  b += round_up(sizeof(RankCtl) * size_t(n), kPage);
  b += round_up(2 * sizeof(Line) * size_t(n) * size_t(n), kPage);
  b += size_t(n) * staging;
  b += round_up(size_t(n) * size_t(n) * 2 * (kPairHeader + pair_slot), kPage);
  return b + flight_bytes(n, flight_slots) + gpu_print_bytes(n);
}

Segment::Segment(const Params& p, char* base, size_t bytes) : p_(p), base_(base), bytes_(bytes) {
  const size_t n = size_t(p.size);
  ctl_off_ = kPage;
  pair_ctl_off_ = ctl_off_ + round_up(sizeof(RankCtl) * n, kPage);
  staging_off_ = pair_ctl_off_ + round_up(2 * sizeof(Line) * n * n, kPage);
  pair_data_off_ = staging_off_ + n * p.staging_bytes;
  flight_off_ = pair_data_off_ + round_up(n * n * 2 * (kPairHeader + p.pair_slot_bytes), kPage);
  gpu_off_ = flight_off_ + flight_bytes(int(n), p.flight_slots);
}

Segment::~Segment() { munmap(base_, bytes_); }

char* Segment::pair_slot(int src, int dst, uint64_t slot) const {
  size_t per_slot = kPairHeader + p_.pair_slot_bytes;
  size_t idx = (size_t(src) * size_t(p_.size) + size_t(dst)) * 2 + size_t(slot & 1);
  return base_ + pair_data_off_ + idx * per_slot;
}

std::unique_ptr<Segment> Segment::create(const Params& p) {
  if (p.size < 1 || p.staging_bytes % kPage || p.staging_bytes < 2 * kPage ||
      p.pair_slot_bytes % 64 || p.flight_slots > kMaxFlightSlots)
    throw InvalidArgument("bad segment parameters for " + p.name);
  const size_t bytes = bytes_needed(p.size, p.staging_bytes, p.pair_slot_bytes, p.flight_slots);
  struct statvfs vfs;
  if (statvfs("/dev/shm", &vfs) == 0) {
    size_t avail = size_t(vfs.f_bavail) * size_t(vfs.f_frsize);
    if (avail < bytes) {
      std::ostringstream m;
      m << "/dev/shm is too small for a " << p.size << "-rank communicator: it needs " << bytes
        << " bytes (" << p.staging_bytes << " bytes of staging per rank; set buffer_bytes= or "
        << "PLAIT_BUFFER_BYTES lower) but only " << avail << " bytes are free";
      throw PlaitError(m.str());
    }
  }
  int fd = shm_open(p.name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw PlaitError("cannot create shared memory " + p.name + ": " + errno_text(errno));
  auto fail = [&](const std::string& what, int e) {
    close(fd);
    shm_unlink(p.name.c_str());
    std::ostringstream m;
    m << "cannot create shared memory " << p.name << " of " << bytes << " bytes: " << what << ": "
      << errno_text(e);
    if (e == ENOSPC) m << " (/dev/shm is full; lower buffer_bytes / PLAIT_BUFFER_BYTES)";
    throw PlaitError(m.str());
  };
  if (fchmod(fd, 0600) != 0) fail("fchmod", errno);
  if (ftruncate(fd, off_t(bytes)) != 0) fail("ftruncate", errno);
  // Reserve the pages now: a sparse tmpfs file would SIGBUS later when /dev/shm runs out.
  if (int e = posix_fallocate(fd, 0, off_t(bytes))) fail("posix_fallocate", e);
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) fail("mmap", errno);
  close(fd);
  std::unique_ptr<Segment> seg(new Segment(p, static_cast<char*>(base), bytes));
  SegHeader* h = seg->header();
  h->version = kVersion;
  h->size = uint32_t(p.size);
  h->token[0] = p.token[0];
  h->token[1] = p.token[1];
  h->staging_bytes = p.staging_bytes;
  h->pair_slot_bytes = p.pair_slot_bytes;
  h->total_bytes = bytes;
  h->flight_slots = p.flight_slots;
  h->attached.store(1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic, std::memory_order_release);
  if (p.size == 1) seg->unlink();
  return seg;
}

std::unique_ptr<Segment> Segment::open(const Params& p) {
  if (p.flight_slots > kMaxFlightSlots)
    throw InvalidArgument("bad segment parameters for " + p.name);
  const size_t bytes = bytes_needed(p.size, p.staging_bytes, p.pair_slot_bytes, p.flight_slots);
  int fd = shm_open(p.name.c_str(), O_RDWR, 0);
  if (fd < 0) throw PlaitError("cannot open shared memory " + p.name + ": " + errno_text(errno));
  struct stat st;
  std::string refuse;
  if (fstat(fd, &st) != 0) {
    refuse = "fstat failed: " + errno_text(errno);
  } else if (st.st_uid != geteuid()) {
    refuse = "it belongs to uid " + std::to_string(st.st_uid);
  } else if ((st.st_mode & 0077) != 0) {
    refuse = "its mode lets other users in";
  } else if (size_t(st.st_size) != bytes) {
    refuse =
        "its size is " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes);
  }
  if (!refuse.empty()) {
    close(fd);
    throw PlaitError("refusing shared memory " + p.name + ": " + refuse);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  close(fd);
  if (base == MAP_FAILED)
    throw PlaitError("cannot map shared memory " + p.name + ": " + errno_text(e));
  std::unique_ptr<Segment> seg(new Segment(p, static_cast<char*>(base), bytes));
  SegHeader* h = seg->header();
  uint64_t magic =
      reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load(std::memory_order_acquire);
  if (magic != kMagic || h->version != kVersion || h->size != uint32_t(p.size) ||
      h->token[0] != p.token[0] || h->token[1] != p.token[1] ||
      h->staging_bytes != p.staging_bytes || h->pair_slot_bytes != p.pair_slot_bytes ||
      h->total_bytes != bytes || h->flight_slots != p.flight_slots)
    throw PlaitError("refusing shared memory " + p.name +
                     ": it is not the segment this job created (stale or foreign)");
  if (h->attached.fetch_add(1, std::memory_order_acq_rel) + 1 == uint32_t(p.size)) seg->unlink();
  return seg;
}

void Segment::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(p_.name.c_str());  // ENOENT: another rank got there first
}

// ---------------------------------------------------------------------------------------------

ShmTransport::ShmTransport(Segment& seg, int rank, const WaitPolicy& policy, AlgoNames algo_names)
    : seg_(seg), policy_(policy), algo_names_(algo_names) {
  rank_ = rank;
  size_ = seg.params().size;
  verified_.assign(size_t(size_), 0);
  last_live_check_.assign(size_t(size_), 0.0);
  // Peers read this word to learn whether they can read this process (probe_peers).
  probe_word_ = probe_value(seg.header(), rank);
  seg.ctl(rank)->probe_addr = reinterpret_cast<uint64_t>(&probe_word_);
}

void ShmTransport::post(int ch, int64_t step) {
  if (ch != 0) arrive();
  post_ctr(rank_, ch).store(epoch_ + uint64_t(step), std::memory_order_release);
  arrived_ = true;  // a channel-0 post at this epoch is also the arrival
}

// Arrival (channel 0 at the call's epoch, next to the fingerprint) is published lazily: by the
// first post, or before the first wait, so a call that posts before it waits (one_shot) moves
// one cache line to each peer instead of two.
void ShmTransport::arrive() {
  if (arrived_) return;
  arrived_ = true;
  seg_.ctl(rank_)->post0[seq_ & 1].v.store(epoch_, std::memory_order_release);
}

void ShmTransport::ack(int ch, int64_t step) {
  seg_.ctl(rank_)->ack[ch].store(epoch_ + uint64_t(step), std::memory_order_release);
}

// A peer's fingerprint is compared as soon as it has arrived, before waiting for anything else
// from it: ranks that disagree (two ranks that both think they are the root, say) may never post
// what the other waits for, and must get a MismatchError rather than a timeout.
void ShmTransport::meet(int peer) {
  arrive();
  auto& arrival = seg_.ctl(peer)->post0[seq_ & 1].v;
  if (arrival.load(std::memory_order_acquire) < epoch_)
    slow_wait([&] { return arrival.load(std::memory_order_acquire) >= epoch_; }, peer,
              FlightWait::arrival, 0);
  verify(peer);
}

void ShmTransport::wait_post(int peer, int ch, int64_t step) {
  arrive();
  if (!verified_[size_t(peer)]) meet(peer);
  const uint64_t target = epoch_ + uint64_t(step);
  auto& c = post_ctr(peer, ch);
  if (c.load(std::memory_order_acquire) < target)
    slow_wait([&] { return c.load(std::memory_order_acquire) >= target; }, peer, FlightWait::post,
              uint64_t(step));
}

void ShmTransport::wait_ack(int peer, int ch, int64_t step) {
  if (step <= 0) return;
  arrive();
  if (!verified_[size_t(peer)]) meet(peer);
  const uint64_t target = epoch_ + uint64_t(step);
  auto& c = seg_.ctl(peer)->ack[ch];
  if (c.load(std::memory_order_acquire) < target)
    slow_wait([&] { return c.load(std::memory_order_acquire) >= target; }, peer, FlightWait::ack,
              uint64_t(step));
}

void ShmTransport::begin(const CallArgs& a, const char* algo_name, uint64_t seq, uint8_t algo_idx,
                         double now) {
  call_ = &a;
  algo_name_ = algo_name;
  seq_ = seq;
  epoch_ = seq << kStepBits;
  half_ = (seq & 1) * staging_bytes();
  deadline_ = (now > 0 ? now : now_s()) + a.timeout_s;
  std::fill(verified_.begin(), verified_.end(), 0);
  verified_[size_t(rank_)] = 1;
  throw_if_aborted();
  // This call reuses the staging half and post line of call seq-2. No wait is needed for that:
  // every call ends only after every peer has arrived in it (end() meets them all), and a peer
  // arrives in call seq-1 only after finishing call seq-2.
  RankCtl* me = seg_.ctl(rank_);
  me->cur_seq.store(seq, std::memory_order_relaxed);
  Fingerprint& f = me->post0[seq & 1].fp;
  f.seq = seq;
  f.count = a.count;
  f.root = a.root;
  f.coll = uint8_t(a.coll);
  f.dtype = uint8_t(a.dtype);
  f.op = uint8_t(a.op);
  f.algo = algo_idx;
  arrived_ = false;
}

void ShmTransport::end() {
  // Every rank compares its call with every peer's before it returns, so that when ranks disagree
  // each of them raises in this call. Most algorithms have met every peer by now; the others
  // (a broadcast root, say) only wait here for the peers' arrival, not for their completion.
  arrive();
  for (int p = 0; p < size_; ++p)
    if (!verified_[size_t(p)]) meet(p);
  seg_.ctl(rank_)->done.store(seq_, std::memory_order_release);
  call_ = nullptr;
}

namespace {
std::string describe(uint64_t seq, Coll c, DType dt, int64_t count, RedOp op, int root,
                     const char* algo) {
  std::ostringstream m;
  m << coll_name(c) << " #" << seq;
  if (c == Coll::barrier) return m.str();
  m << " (" << dtype_name(dt) << ", count=" << count;
  if (c == Coll::allreduce || c == Coll::reduce_scatter || c == Coll::reduce)
    m << ", op=" << op_name(op);
  if (c == Coll::broadcast || c == Coll::reduce) m << ", root=" << root;
  if (algo && *algo) m << ", algorithm=" << algo;
  m << ")";
  return m.str();
}
}  // namespace

std::string ShmTransport::describe_call() const {
  if (!call_) return "no call";
  if (call_->coll == Coll::send || call_->coll == Coll::recv) {
    std::ostringstream m;
    m << coll_name(call_->coll) << (call_->coll == Coll::send ? " to rank " : " from rank ")
      << call_->peer << " (tag=" << call_->tag << ", " << dtype_name(call_->dtype)
      << ", count=" << call_->count << ")";
    return m.str();
  }
  return describe(seq_, call_->coll, call_->dtype, call_->count, call_->op, call_->root,
                  algo_name_);
}

std::string fingerprint_diff(const Fingerprint& a, const Fingerprint& b, bool with_algo) {
  std::string diff;
  auto field = [&](bool differs, const char* name) {
    if (differs) diff += (diff.empty() ? "" : ", ") + std::string(name);
  };
  field(a.seq != b.seq, "call number");
  field(a.coll != b.coll, "collective");
  field(a.dtype != b.dtype, "dtype");
  field(a.count != b.count, "count");
  field(a.op != b.op, "op");
  field(a.root != b.root, "root");
  field(with_algo && a.algo != b.algo, "algorithm");
  return diff;
}

void ShmTransport::verify(int peer) {
  const Fingerprint mine = seg_.ctl(rank_)->post0[seq_ & 1].fp;
  Fingerprint f;
  std::memcpy(&f, &seg_.ctl(peer)->post0[seq_ & 1].fp, sizeof f);
  if (std::memcmp(&f, &mine, sizeof f) == 0) {  // the per-call path: no strings, no streams
    verified_[size_t(peer)] = 1;
    return;
  }
  const std::string diff = fingerprint_diff(f, mine, true);
  if (diff.empty()) {
    verified_[size_t(peer)] = 1;
    return;
  }
  auto safe_enum = [](uint8_t v, uint8_t n) { return v < n ? v : 0; };
  auto algo_of = [this](uint8_t coll, uint8_t idx) -> const char* {
    return coll < uint8_t(Coll::kCount) ? algo_names_(Coll(coll), idx) : "?";
  };
  std::ostringstream m;
  m << "mismatched calls: rank " << peer << " called "
    << describe(f.seq, Coll(safe_enum(f.coll, uint8_t(Coll::kCount))),
                DType(safe_enum(f.dtype, uint8_t(DType::kCount))), f.count,
                RedOp(safe_enum(f.op, uint8_t(RedOp::kCount))), f.root, algo_of(f.coll, f.algo))
    << " but rank " << rank_ << " called "
    << describe(mine.seq, Coll(mine.coll), DType(mine.dtype), mine.count, RedOp(mine.op), mine.root,
                algo_of(mine.coll, mine.algo))
    << "; they differ in " << diff;
  fail(ErrorKind::mismatch, m.str());
}

void ShmTransport::set_deadline(double deadline, const CallArgs* a, const char* algo_name) {
  deadline_ = deadline;
  call_ = a;
  algo_name_ = algo_name;
}

bool ShmTransport::aborted() const {
  return seg_.header()->abort_kind.load(std::memory_order_relaxed) != 0;
}

void ShmTransport::throw_if_aborted() {
  SegHeader* h = seg_.header();
  uint32_t k = h->abort_kind.load(std::memory_order_acquire);
  if (k == 0) return;
  double give_up = now_s() + 1.0;  // the writer may have died between claiming and publishing
  while (k == kWriting && now_s() < give_up) {
    sched_yield();
    k = h->abort_kind.load(std::memory_order_acquire);
  }
  if (k == kWriting)
    throw PlaitError("communicator aborted by a rank that died while reporting why");
  char buf[sizeof h->abort_msg + 1];
  std::memcpy(buf, h->abort_msg, sizeof h->abort_msg);
  buf[sizeof h->abort_msg] = 0;
  // The text comes from shared memory that any rank may have scribbled over: plait writes only
  // ASCII there, so anything else becomes '?' (Python would fail to decode it as UTF-8).
  for (char* c = buf; *c; ++c)
    if ((*c < 0x20 && *c != '\n' && *c != '\t') || *c == 0x7f || (unsigned char)*c >= 0x80)
      *c = '?';
  ErrorKind kind = k <= uint32_t(ErrorKind::peer_lost) ? ErrorKind(k) : ErrorKind::generic;
  throw_error(kind, buf);
}

void ShmTransport::fail(ErrorKind kind, const std::string& msg) {
  SegHeader* h = seg_.header();
  uint32_t expect = 0;
  if (h->abort_kind.compare_exchange_strong(expect, kWriting, std::memory_order_acq_rel)) {
    size_t n = std::min(msg.size(), sizeof h->abort_msg - 1);
    std::memcpy(h->abort_msg, msg.data(), n);
    h->abort_msg[n] = 0;
    h->abort_rank = rank_;
    h->abort_kind.store(uint32_t(kind), std::memory_order_release);
    throw_error(kind, msg);
  }
  throw_if_aborted();
  throw_error(kind, msg);
}

bool ShmTransport::peer_gone(int p, std::string* why, bool* died) {
  RankCtl* c = seg_.ctl(p);
  uint32_t st = c->state.load(std::memory_order_acquire);
  if (st == kStarting) return false;
  if (st == kAlive) {
    int rc = pthread_mutex_trylock(&c->alive);
    if (rc == EBUSY) return false;
    if (rc == EOWNERDEAD) {
      c->state.store(kDead, std::memory_order_release);
      pthread_mutex_consistent(&c->alive);
      pthread_mutex_unlock(&c->alive);
      st = kDead;
    } else if (rc == 0) {
      pthread_mutex_unlock(&c->alive);
      st = c->state.load(std::memory_order_acquire);
      if (st == kAlive) st = kDead;  // its progress thread is gone without an orderly exit
    } else {
      st = kDead;
    }
  }
  std::ostringstream m;
  m << "rank " << p << " (pid " << c->pid << ")"
    << (st == kExited ? " has left the communicator (finalized or exited)" : " died");
  *why = m.str();
  if (died) *died = st != kExited;
  return true;
}

void ShmTransport::check(double t, int peer) {
  ErrorKind kind;
  std::string msg;
  if (!healthy(t, peer, &kind, &msg)) fail(kind, msg);
}

bool ShmTransport::healthy(double t, int peer, ErrorKind* kind, std::string* msg) {
  if (aborted()) throw_if_aborted();
  if (t > deadline_) {
    *kind = ErrorKind::timeout;
    *msg = deadline_message(peer);
    return false;
  }
  if (peer >= 0 && t - last_live_check_[size_t(peer)] > 2e-3) {
    last_live_check_[size_t(peer)] = t;
    std::string why;
    if (peer_gone(peer, &why)) {
      *kind = ErrorKind::peer_lost;
      *msg = why + " during " + describe_call() + "; noticed by rank " + std::to_string(rank_);
      return false;
    }
  }
  return true;
}

std::string ShmTransport::deadline_message(int peer) {
  std::ostringstream m;
  m << "rank " << rank_ << ": " << describe_call() << " timed out after "
    << (call_ ? call_->timeout_s : 0.0) << " s";
  if (peer >= 0) m << " waiting for rank " << peer;
  if (call_ && call_->coll != Coll::send && call_->coll != Coll::recv) {
    std::ostringstream late;
    for (int p = 0; p < size_; ++p) {
      uint64_t s = seg_.ctl(p)->cur_seq.load(std::memory_order_relaxed);
      if (p != rank_ && s < seq_)
        late << (late.tellp() > 0 ? ", " : "") << p << " (at call #" << s << ")";
    }
    if (late.tellp() > 0) m << "; ranks that have not arrived: " << late.str();
  }
  return m.str();
}

// ---------------------------------------------------------------------------------------------
// Single copy between address spaces: process_vm_readv (Linux cross-memory attach). The kernel
// copies straight from the peer's pages into ours, so a peer's input is read once instead of
// being staged and copied again. Whether the kernel lets us (same user, ptrace access mode,
// seccomp) is probed once per communicator, and used only if every rank can read every peer.

void ShmTransport::probe_peers(bool allow) {
  std::string why;
  if (!allow) why = "disabled by PLAIT_SINGLE_COPY=0";
  peer_pid_.assign(size_t(size_), 0);
  for (int p = 0; p < size_ && why.empty(); ++p) {
    if (p == rank_) continue;
    RankCtl* c = seg_.ctl(p);
    peer_pid_[size_t(p)] = c->pid;
    uint64_t got = 0;
    iovec local{&got, sizeof got};
    iovec remote{reinterpret_cast<void*>(c->probe_addr), sizeof got};
    ssize_t n = process_vm_readv(pid_t(c->pid), &local, 1, &remote, 1, 0);
    // Writing needs the same permission; the probe writes back what it read.
    if (n == ssize_t(sizeof got)) n = process_vm_writev(pid_t(c->pid), &local, 1, &remote, 1, 0);
    if (n != ssize_t(sizeof got)) {
      std::ostringstream m;
      m << "rank " << rank_ << " cannot read or write rank " << p << " (pid " << c->pid
        << ") with process_vm_readv/writev: " << (n < 0 ? errno_text(errno) : "short read");
      why = m.str();
    } else if (got != probe_value(seg_.header(), p)) {
      why = "rank " + std::to_string(rank_) + " read an unexpected probe word from rank " +
            std::to_string(p);
    }
  }
  no_read_why_ = why;
  seg_.ctl(rank_)->can_read.store(why.empty() ? 1 : 2, std::memory_order_release);
}

void ShmTransport::agree_on_reads(double deadline) {
  bool all = true;
  for (int p = 0; p < size_; ++p) {
    auto& flag = seg_.ctl(p)->can_read;
    Backoff b(policy_);
    while (flag.load(std::memory_order_acquire) == 0) {
      b.idle([&](double t) {
        throw_if_aborted();
        if (t > deadline)
          fail(ErrorKind::timeout, "rank " + std::to_string(rank_) + ": rank " + std::to_string(p) +
                                       " did not finish joining the communicator in time");
      });
    }
    if (flag.load(std::memory_order_acquire) != 1) {
      all = false;
      if (no_read_why_.empty())
        no_read_why_ = "rank " + std::to_string(p) + " cannot read its peers";
    }
  }
  can_read_ = all;
}

void ShmTransport::expose(const void* in, void* out) {
  uint64_t* a = seg_.ctl(rank_)->addr[seq_ & 1];
  a[0] = reinterpret_cast<uint64_t>(in);
  a[1] = reinterpret_cast<uint64_t>(out);
  // Published only where peers could use it (they map through the same permission as CMA).
  RegionRef* r = seg_.ctl(rank_)->reg[seq_ & 1];
  r[0] = r[1] = RegionRef{};
  if (!can_read_) return;
  if (in) shared_find(in, 1, &r[0]);
  if (out) shared_find(out, 1, &r[1]);
}

char* ShmTransport::map_peer(int p, const char* remote, size_t bytes) {
  if (!can_read_) return nullptr;
  const uintptr_t a = reinterpret_cast<uintptr_t>(remote);
  for (const RegionRef& r : seg_.ctl(p)->reg[seq_ & 1]) {
    if (!r.id || a < r.base || a + bytes > r.base + r.bytes) continue;
    char* base = maps_.map(peer_pid_[size_t(p)], r);
    return base ? base + (a - r.base) : nullptr;
  }
  return nullptr;
}

char* ShmTransport::peer_local(int p, const char* remote, size_t bytes) {
  char* m = map_peer(p, remote, bytes);
  if (m) mapped_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return m;
}

const char* ShmTransport::peer_in(int p) {
  return reinterpret_cast<const char*>(seg_.ctl(p)->addr[seq_ & 1][0]);
}

const char* ShmTransport::peer_out(int p) {
  return reinterpret_cast<const char*>(seg_.ctl(p)->addr[seq_ & 1][1]);
}

void ShmTransport::read_peer(int p, void* dst, const char* src, size_t bytes) {
  if (const char* m = peer_local(p, src, bytes)) {
    copy_out(dst, m, bytes);
    return;
  }
  copy_peer(false, p, static_cast<char*>(dst), const_cast<char*>(src), bytes);
}

void ShmTransport::write_peer(int p, char* dst, const void* src, size_t bytes, bool stream) {
  if (char* m = peer_local(p, dst, bytes)) {
    if (stream)
      stream_copy(m, src, bytes);
    else
      std::memcpy(m, src, bytes);
    return;
  }
  copy_peer(true, p, static_cast<char*>(const_cast<void*>(src)), dst, bytes);
}

void ShmTransport::copy_peer(bool write, int p, char* local, char* remote, size_t bytes) {
  // Pieces of a few MiB, so that an abort, the deadline or a dead peer is noticed in between.
  constexpr size_t kPiece = size_t(8) << 20;
  while (bytes) {
    const size_t want = std::min(bytes, kPiece);
    iovec l{local, want};
    iovec r{remote, want};
    const pid_t pid = pid_t(peer_pid_[size_t(p)]);
    const ssize_t n =
        write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (n <= 0) {
      const int e = n < 0 ? errno : EIO;
      std::string why;
      if (e == ESRCH || peer_gone(p, &why))
        fail(ErrorKind::peer_lost, (why.empty() ? "rank " + std::to_string(p) + " died" : why) +
                                       " during " + describe_call() + "; noticed by rank " +
                                       std::to_string(rank_));
      fail(ErrorKind::generic, "rank " + std::to_string(rank_) + ": " + describe_call() + ": " +
                                   (write ? "writing" : "reading") + " rank " + std::to_string(p) +
                                   "'s buffer failed: " + errno_text(e));
    }
    local += n, remote += n, bytes -= size_t(n);
    if (bytes) check(now_s(), p);
  }
}

}  // namespace plait
