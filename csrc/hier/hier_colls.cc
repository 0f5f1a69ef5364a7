// The collectives of the multi-host communicator (steps in hier/hier_comm.h). Local steps run
// inline on this thread (the call is one closure task of the local communicator); engine steps
// go to the inter group (or the world group for alltoall and send/recv between hosts).
#include <algorithm>
#include <cstring>

#include "core/wait.h"
#include "hier/hier_comm.h"

namespace plait {

namespace {
Buffer host(const void* p, size_t bytes, DType dt) {
  Buffer b;
  b.ptr = const_cast<void*>(p);
  b.bytes = bytes;
  b.dtype = dt;
  b.present = true;
  return b;
}
}  // namespace

void HierComm::local(Coll c, const void* in, size_t in_bytes, void* out, size_t out_bytes, DType dt,
                     RedOp op, int root, double deadline, bool has_out) {
  const double t = deadline - now_s();
  const Buffer bi = c == Coll::barrier ? Buffer{} : host(in, in_bytes, dt);
  const Buffer bo = (c == Coll::barrier || !has_out) ? Buffer{} : host(out, out_bytes, dt);
  try {
    local_->call(c, bi, bo, op, root, -1, 0, "", t > 1e-3 ? t : 1e-3, false);
  } catch (const PlaitError& e) {
    // The local communicator numbers its own ranks: say which global ranks they are.
    throw_error(e.kind(), "rank " + std::to_string(rank_) + ": local " + coll_name(c) +
                              " on host " + std::to_string(lay_.h) + ": " + e.what() + " [" +
                              lay_.describe_host(lay_.h) + "]");
  }
}

void HierComm::local_barrier(double deadline) {
  local(Coll::barrier, nullptr, 0, nullptr, 0, DType::u8, RedOp::sum, 0, deadline);
}

void HierComm::allreduce(const CallArgs& a, const Fingerprint& fp, const void* x, void* out,
                         double deadline) {
  const int64_t n = a.count;
  const DType dt = a.dtype;
  const size_t es = dtype_size(dt), bytes = size_t(n) * es;
  const int L = local_->size();
  const RedOp op = a.op, red = op == RedOp::avg ? RedOp::sum : op;
  auto* o = static_cast<uint8_t*>(out);
  wants(bytes);
  if (lay_.uniform) {
    if (fits(bytes)) {
      // The input is the frame's payload: local rank i reduces its shard group's inputs (the
      // same bytes on every host), then the host's ranks reduce those in place.
      std::memcpy(inter_->room(), x, bytes);
      const uint8_t* rows = exchange(inter_.get(), fp, bytes, deadline);
      combine(out, rows, inter_->size(), 0, n, dt, red);
      if (n)
        local(Coll::allreduce, out, bytes, out, bytes, dt, red, 0, deadline);
      else
        local_barrier(deadline);
      if (op == RedOp::avg) divide(out, n, dt);
      return;
    }
    allreduce_pieces(a, fp, x, o, deadline);
    return;
  }
  // Leaders: local reduce to the leader, leaders' allreduce, local broadcast.
  const bool leader = lay_.i == 0, small = inter_ && fits(bytes);
  Posted checked;
  if (!small) checked = post(inter_.get(), fp, 0, true, deadline);  // the leaders' check
  local(Coll::reduce, x, bytes, out, bytes, dt, red, 0, deadline, leader);
  if (leader) {
    if (small) {
      std::memcpy(inter_->room(), out, bytes);
      const uint8_t* rows = exchange(inter_.get(), fp, bytes, deadline);
      combine(out, rows, inter_->size(), 0, n, dt, op);
    } else {
      finish(checked, deadline);
      inter_->allreduce(out, n, dt, red, deadline);
      if (op == RedOp::avg) divide(out, n, dt);
    }
  }
  local(Coll::broadcast, out, bytes, out, bytes, dt, red, 0, deadline);
}

void HierComm::allreduce_pieces(const CallArgs& a, const Fingerprint& fp, const void* x, uint8_t* o,
                                double deadline) {
  const int64_t n = a.count, L = local_->size();
  const DType dt = a.dtype;
  const size_t es = dtype_size(dt);
  const RedOp op = a.op, red = op == RedOp::avg ? RedOp::sum : op;
  const bool last = lay_.i == L - 1;
  const auto* xb = static_cast<const uint8_t*>(x);
  // Pieces of pe elements (a multiple of L: only the last piece has a remainder); one piece
  // when there is no local step to overlap (L = 1: pieces would only add engine round trips)
  // or the engine cannot start an allreduce and return. The piece size is in the checked frame
  // (the fingerprint's algorithm field, unused across hosts otherwise), so hosts that cut the
  // payload differently (PLAIT_HIER_PIECE_BYTES set unevenly) raise a mismatch before any
  // payload moves.
  int64_t pe = n;
  Fingerprint checked_fp = fp;
  if (piece_log2_ > 0 && L > 1 && inter_->can_start(dt, red)) {
    pe = std::max<int64_t>(L, int64_t((size_t(1) << piece_log2_) / es) / L * L);
    checked_fp.algo = uint8_t(piece_log2_);
  }
  const int64_t pieces = std::max<int64_t>(1, (n + pe - 1) / pe);
  struct Piece {
    int64_t s, f, r, lo, hi;  // first element, block, remainder, this rank's owned [lo, hi)
  };
  auto piece = [&](int64_t k) {
    Piece p;
    p.s = k * pe;
    const int64_t c = std::min(pe, n - p.s);
    p.f = c / L;
    p.r = c % L;
    p.lo = p.s + lay_.i * p.f;
    p.hi = (p.r && last) ? p.s + c : p.lo + p.f;
    return p;
  };
  // 1. local reduce_scatter of the piece's L blocks (the remainder reduced to the last rank)
  auto scatter = [&](int64_t k) {
    const Piece p = piece(k);
    const size_t tail = size_t(p.s + L * p.f) * es;
    if (p.f)
      local(Coll::reduce_scatter, xb + size_t(p.s) * es, size_t(L * p.f) * es,
            o + size_t(p.lo) * es, size_t(p.f) * es, dt, red, 0, deadline);
    if (p.r)
      local(Coll::reduce, xb + tail, size_t(p.r) * es, o + tail, size_t(p.r) * es, dt, red,
            int(L - 1), deadline, last);
  };
  // 2. the engine's allreduce of what this rank owns, across the hosts (started, then waited)
  auto start = [&](int64_t k) {
    const Piece p = piece(k);
    return inter_->allreduce_start(o + size_t(p.lo) * es, p.hi - p.lo, dt, red, deadline);
  };
  // 3. local allgather of the owned blocks in place; broadcast of the remainder
  auto gather = [&](int64_t k) {
    const Piece p = piece(k);
    const size_t tail = size_t(p.s + L * p.f) * es;
    if (op == RedOp::avg) divide(o + size_t(p.lo) * es, p.hi - p.lo, dt);
    if (p.f)
      local(Coll::allgather, o + size_t(p.lo) * es, size_t(p.f) * es, o + size_t(p.s) * es,
            size_t(L * p.f) * es, dt, red, 0, deadline);
    if (p.r)
      local(Coll::broadcast, o + tail, size_t(p.r) * es, o + tail, size_t(p.r) * es, dt, red,
            int(L - 1), deadline);
  };
  // Piece k's engine step runs while this thread gathers piece k - 1 and scatters piece k + 1.
  Posted checked = post(inter_.get(), checked_fp, 0, true, deadline);  // beside the first scatter
  void* req = nullptr;
  try {
    scatter(0);
    finish(checked, deadline);  // no payload goes to the engine before the hosts agree
    req = start(0);
    if (pieces > 1) scatter(1);
    for (int64_t k = 0; k < pieces; ++k) {
      void* r = req;
      req = nullptr;
      inter_->wait(r, deadline);
      if (k + 1 < pieces) req = start(k + 1);
      gather(k);
      if (k + 2 < pieces) scatter(k + 2);
    }
  } catch (const PlaitError& e) {
    if (req) {
      // A local step failed with an engine step in flight: end it (the engine keeps the first
      // failure it is told, so the same message on_error gives) before the buffer is let go.
      std::string msg = e.what();
      const std::string me = "rank " + std::to_string(rank_) + ": ";
      if (msg.compare(0, me.size(), me) != 0) msg = head(a) + ": " + msg;
      inter_->fail(e.kind(), msg);
      try {
        inter_->wait(req, deadline);
      } catch (const PlaitError&) {  // the failure above, as the engine reports it
      }
    }
    throw;
  }
}

void HierComm::reduce_scatter(const CallArgs& a, const Fingerprint& fp, double deadline) {
  const int64_t m = a.count;
  const DType dt = a.dtype;
  const size_t es = dtype_size(dt), mb = size_t(m) * es;
  const RedOp op = a.op, red = op == RedOp::avg ? RedOp::sum : op;
  const auto* x = static_cast<const uint8_t*>(a.in);
  auto* out = static_cast<uint8_t*>(a.out);
  if (m == 0) {
    exchange(inter_.get(), fp, 0, deadline, /*check_only=*/true);
    local_barrier(deadline);
    return;
  }
  if (!lay_.uniform) {
    std::vector<uint8_t> full(mb * size_t(size_));
    CallArgs all = a;
    all.count = m * size_;
    allreduce(all, fp, x, full.data(), deadline);
    std::memcpy(out, full.data() + size_t(rank_) * mb, mb);
    return;
  }
  const int H = lay_.nhosts();
  const size_t zb = size_t(H) * mb;
  wants(zb);
  const bool small = fits(zb);
  Posted checked;
  if (!small) checked = post(inter_.get(), fp, 0, true, deadline);
  // y block (i * H + h) = the block of rank (h, i): hosts interleaved in rank order need no copy
  std::vector<uint8_t> yv;
  const uint8_t* y = x;
  if (!lay_.in_order) {
    yv.resize(mb * size_t(size_));
    for (size_t k = 0; k < size_t(size_); ++k)
      std::memcpy(yv.data() + k * mb, x + size_t(lay_.perm[k]) * mb, mb);
    y = yv.data();
  }
  std::vector<uint8_t> zv;
  uint8_t* z = small ? inter_->room() : (zv.resize(zb), zv.data());
  local(Coll::reduce_scatter, y, zb * size_t(local_->size()), z, zb, dt, red, 0, deadline);
  if (small) {
    // every host's H blocks in the frame; this rank reduces block h of each into out
    const uint8_t* rows = exchange(inter_.get(), fp, zb, deadline);
    combine(out, rows, H, size_t(lay_.h) * mb, m, dt, op);
    return;
  }
  finish(checked, deadline);
  // The engines have no reduce-scatter here: allreduce all H blocks, keep ours (H x the bytes
  // of an inter-host reduce-scatter; see docs/api.md).
  inter_->allreduce(z, m * H, dt, red, deadline);
  uint8_t* mine = z + size_t(lay_.h) * mb;
  if (op == RedOp::avg) divide(mine, m, dt);
  std::memcpy(out, mine, mb);
}

void HierComm::allgather(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t n,
                         double deadline) {
  const int H = lay_.nhosts(), L = local_->size();
  if (n == 0) {
    exchange(inter_.get(), fp, 0, deadline, /*check_only=*/true);
    local_barrier(deadline);
    return;
  }
  if (lay_.uniform) {
    wants(n);
    std::vector<uint8_t> av(size_t(H) * n);
    if (fits(n)) {
      std::memcpy(inter_->room(), x, n);
      const uint8_t* rows = exchange(inter_.get(), fp, n, deadline);
      for (int h = 0; h < H; ++h) std::memcpy(av.data() + size_t(h) * n, rows + h * frame(), n);
    } else {
      exchange(inter_.get(), fp, 0, deadline, /*check_only=*/true);
      inter_->allgather(x, av.data(), n, deadline);  // av[h] = x of rank (h, i)
    }
    std::vector<uint8_t> bv;
    uint8_t* b = lay_.in_order ? out : (bv.resize(size_t(L * H) * n), bv.data());
    local(Coll::allgather, av.data(), av.size(), b, size_t(L * H) * n, DType::u8, RedOp::sum, 0,
          deadline);  // b[i, h] = x of rank (h, i)
    if (b != out)
      for (size_t k = 0; k < size_t(L * H); ++k)
        std::memcpy(out + size_t(lay_.perm[k]) * n, b + k * n, n);
    return;
  }
  // Leaders: host h's inputs in slot h of `every`, slots of the largest host's size (the slack
  // of a smaller host is carried, zeroed).
  size_t lmax = 0;
  for (const auto& m : lay_.hosts) lmax = std::max(lmax, m.size());
  const size_t slot = lmax * n, mn = size_t(L) * n;
  std::vector<uint8_t> every(size_t(H) * slot);
  wants(slot);
  const bool leader = lay_.i == 0, small = leader && fits(slot);
  std::vector<uint8_t> mv;
  uint8_t* mine = small    ? inter_->room()
                  : leader ? (mv.resize(slot), mv.data())
                           : every.data() + size_t(lay_.h) * slot;
  Posted checked;
  if (!small) checked = post(inter_.get(), fp, 0, true, deadline);  // the leaders' check
  local(Coll::allgather, x, n, mine, mn, DType::u8, RedOp::sum, 0, deadline);
  if (leader) {
    std::memset(mine + mn, 0, slot - mn);  // no stale bytes leave the host
    if (small) {
      const uint8_t* rows = exchange(inter_.get(), fp, slot, deadline);
      for (int h = 0; h < H; ++h)
        std::memcpy(every.data() + size_t(h) * slot, rows + h * frame(), slot);
    } else {
      finish(checked, deadline);
      inter_->allgather(mine, every.data(), slot, deadline);
    }
  }
  local(Coll::broadcast, every.data(), every.size(), every.data(), every.size(), DType::u8,
        RedOp::sum, 0, deadline);
  for (int h = 0; h < H; ++h) {
    const auto& members = lay_.hosts[size_t(h)];
    for (size_t j = 0; j < members.size(); ++j)
      std::memcpy(out + size_t(members[j]) * n, every.data() + size_t(h) * slot + j * n, n);
  }
}

void HierComm::inter_broadcast(const Fingerprint& fp, uint8_t* out, size_t k, int hr,
                               double deadline) {
  if (fits(k)) {
    if (lay_.h == hr) std::memcpy(inter_->room(), out, k);
    const uint8_t* rows = exchange(inter_.get(), fp, k, deadline);
    if (lay_.h != hr) std::memcpy(out, rows + size_t(hr) * frame(), k);
  } else {
    exchange(inter_.get(), fp, 0, deadline, /*check_only=*/true);
    inter_->broadcast(out, k, hr, deadline);
  }
}

void HierComm::broadcast(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t k, int root,
                         double deadline) {
  const int hr = lay_.host_of[size_t(root)], ir = lay_.local_of[size_t(root)];
  wants(k);
  if (rank_ == root && out != x) std::memmove(out, x, k);
  auto lbcast = [&](int from) {
    local(Coll::broadcast, out, k, out, k, DType::u8, RedOp::sum, from, deadline);
  };
  if (lay_.uniform) {
    Posted checked;
    if (lay_.i != ir)  // not in the root's shard group: the check alone, beside the local step
      checked = post(inter_.get(), fp, 0, true, deadline);
    else
      inter_broadcast(fp, out, k, hr, deadline);
    if (k)
      lbcast(ir);
    else
      local_barrier(deadline);
    finish(checked, deadline);
    return;
  }
  if (k && lay_.h == hr && ir != 0) lbcast(ir);
  if (lay_.i == 0) inter_broadcast(fp, out, k, hr, deadline);
  if (!k)
    local_barrier(deadline);
  else if (lay_.h != hr || ir == 0)
    lbcast(0);
}

void HierComm::alltoall(const Fingerprint& fp, const uint8_t* x, uint8_t* out, size_t blk,
                        double deadline) {
  const size_t total = blk * size_t(size_);
  wants(total);
  if (fits(total)) {
    // every rank's whole input in its frame; this rank keeps its block of each
    std::memcpy(world_->room(), x, total);
    const uint8_t* rows = exchange(world_.get(), fp, total, deadline);
    for (int j = 0; j < size_; ++j)
      std::memcpy(out + size_t(j) * blk, rows + size_t(j) * frame() + size_t(rank_) * blk, blk);
    return;
  }
  exchange(world_.get(), fp, 0, deadline, /*check_only=*/true);
  std::vector<uint8_t> copy;
  if (x == out) {  // in place (the only overlap validation lets through)
    copy.assign(x, x + total);
    x = copy.data();
  }
  world_->alltoall(x, out, blk, deadline);
}

void HierComm::barrier(const Fingerprint& fp, double deadline) {
  local_barrier(deadline);
  if (inter_) exchange(inter_.get(), fp, 0, deadline, /*check_only=*/false);  // hosts' barrier
  local_barrier(deadline);
}

}  // namespace plait
