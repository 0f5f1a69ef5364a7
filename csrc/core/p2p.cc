// send/recv over the per-pair channels of the segment.
// Each ordered pair (src, dst) has two slots of pair_slot_bytes; a message is cut into chunks
// that alternate between them. The sender writes a chunk with its header (message number, tag,
// size, dtype) and bumps `posted`; the receiver checks the header against its own call, copies
// the chunk out and bumps `taken`, which frees the slot. Messages on one pair arrive in order;
// receives match them by (sender, tag) as gloo's do: an async recv takes the first message of
// its tag, one no posted recv wants is copied aside (the stash) for a later recv, so a receiver
// may post tag 9 before tag 7. A blocking (inline) recv takes the next message, which must match.
// Several calls progress together so that exchanges (isend+irecv on both sides) cannot deadlock.
#include <cstring>
#include <sstream>

#include "core/communicator.h"

namespace plait {

// Moves one chunk if the channel allows; false when it has to wait.
bool Communicator::p2p_step(P2P& op) {
  if (op.a->peer == kAnySource && !(op.a->peer = any_source(*op.a), op.a->peer >= 0)) {
    op.a->peer = kAnySource;
    return false;
  }
  const CallArgs& a = *op.a;
  const size_t slot_bytes = seg_->params().pair_slot_bytes;
  const size_t nbytes = size_t(a.count) * dtype_size(a.dtype);
  const bool is_send = a.coll == Coll::send;
  if (!op.started && !is_send) {
    const int stashed = op.stashing ? 0 : take_stashed(op);
    if (stashed) return stashed > 0;
    if (rx_busy_[size_t(a.peer)]) return false;  // another recv is copying a message out
    const uint64_t head = recv_chunk_[size_t(a.peer)];
    if (seg_->pair_posted(a.peer, rank_)->v.load(std::memory_order_acquire) < head + 1)
      return false;
    if (op.task) {  // async: only the message of its tag
      PairSlotHeader h;
      std::memcpy(&h, seg_->pair_slot(a.peer, rank_, head), sizeof h);
      if (h.tag != a.tag) return false;
    }
    rx_busy_[size_t(a.peer)] = 1;
  }
  if (!op.started) {
    op.started = true;
    op.nchunks = nbytes ? (nbytes + slot_bytes - 1) / slot_bytes : 1;
    auto& chunk = is_send ? send_chunk_[size_t(a.peer)] : recv_chunk_[size_t(a.peer)];
    auto& msg = is_send ? send_msg_[size_t(a.peer)] : recv_msg_[size_t(a.peer)];
    op.first = chunk;
    op.msg = msg++;
    chunk += op.nchunks;
    op.t0 = flight_.on() || trace_ ? mono_ns() : 0;
    op.rec = flight_.begin(a, op.msg, 0, op.t0);
    op.idle0 = p2p_idle_ns_;
  }
  const uint64_t g = op.first + op.done;
  const size_t off = size_t(op.done) * slot_bytes;
  const size_t len = nbytes > off ? std::min(slot_bytes, nbytes - off) : 0;
  if (is_send) {
    if (g >= 2 && seg_->pair_taken(rank_, a.peer)->v.load(std::memory_order_acquire) < g - 1)
      return false;
    char* slot = seg_->pair_slot(rank_, a.peer, g);
    PairSlotHeader h{op.msg, a.tag, nbytes, uint32_t(a.dtype)};
    std::memcpy(slot, &h, sizeof h);
    std::memcpy(slot + 64, static_cast<const char*>(a.in) + off, len);
    seg_->pair_posted(rank_, a.peer)->v.store(g + 1, std::memory_order_release);
  } else {
    if (seg_->pair_posted(a.peer, rank_)->v.load(std::memory_order_acquire) < g + 1) return false;
    const char* slot = seg_->pair_slot(a.peer, rank_, g);
    PairSlotHeader h;
    std::memcpy(&h, slot, sizeof h);
    if (h.msg != op.msg || h.tag != a.tag || h.nbytes != nbytes || h.dtype != uint32_t(a.dtype)) {
      std::ostringstream m;
      m << "mismatched send/recv: rank " << rank_ << " called recv from rank " << a.peer
        << " (tag=" << a.tag << ", " << nbytes << " bytes, " << dtype_name(a.dtype) << ") but rank "
        << a.peer << " sent (tag=" << h.tag << ", " << h.nbytes << " bytes, "
        << (h.dtype < uint32_t(DType::kCount) ? dtype_name(DType(h.dtype)) : "?") << ")";
      if (h.msg != op.msg) m << " as message #" << h.msg << " where #" << op.msg << " was expected";
      tp_.fail(ErrorKind::mismatch, m.str());
    }
    std::memcpy(static_cast<char*>(a.out) + off, slot + 64, len);
    seg_->pair_taken(a.peer, rank_)->v.store(g + 1, std::memory_order_release);
    if (op.done + 1 == op.nchunks) rx_busy_[size_t(a.peer)] = 0;
  }
  ++op.done;
  return true;
}

// The sender an any-source recv takes its message from: a stashed message of its tag, else a
// channel whose next message has its tag; -1 while there is none.
int Communicator::any_source(const CallArgs& a) {
  for (int p = 0; p < size_; ++p)
    for (const auto& e : stash_[size_t(p)])
      if (e.a.tag == a.tag && e.p.started && e.p.done == e.p.nchunks) return p;
  for (int p = 0; p < size_; ++p) {
    const uint64_t head = recv_chunk_[size_t(p)];
    if (p == rank_ || rx_busy_[size_t(p)] ||
        seg_->pair_posted(p, rank_)->v.load(std::memory_order_acquire) < head + 1)
      continue;
    PairSlotHeader h;
    std::memcpy(&h, seg_->pair_slot(p, rank_, head), sizeof h);
    if (h.tag == a.tag) return p;
  }
  return -1;
}

int Communicator::ready_source(int64_t tag) {
  if (tl_inside_ != this)
    throw InvalidArgument("rank " + std::to_string(rank_) +
                          ": ready_source is for a closure task's body or a stepped recv on this "
                          "communicator");
  tp_.throw_if_aborted();
  CallArgs want;
  want.coll = Coll::recv;
  want.peer = kAnySource;
  want.tag = tag;
  std::vector<P2P> ops{P2P{&want, nullptr}};
  for (int round = 0; round < 2; ++round) {
    for (auto& st : stash_)  // stashed messages still arriving
      for (auto& e : st)
        while (!(e.p.started && e.p.done == e.p.nchunks) && p2p_step(e.p)) {
        }
    const int p = any_source(want);
    if (p >= 0 || round) return p;
    bool stashed = false;  // heads of other tags go aside, so messages behind them show
    for (int q = 0; q < size_; ++q)
      if (q != rank_ && stash_head(q, ops)) stashed = true;
    if (!stashed) return -1;
  }
  return -1;
}

int Communicator::take_stashed(P2P& op) {
  const CallArgs& a = *op.a;
  auto& st = stash_[size_t(a.peer)];
  for (auto it = st.begin(); it != st.end(); ++it) {
    if (it->a.tag != a.tag) continue;
    if (!it->p.started || it->p.done != it->p.nchunks) return -1;  // still arriving
    const size_t nbytes = size_t(a.count) * dtype_size(a.dtype);
    if (it->buf.size() != nbytes || it->a.dtype != a.dtype) {
      std::ostringstream m;
      m << "mismatched send/recv: rank " << rank_ << " called recv from rank " << a.peer
        << " (tag=" << a.tag << ", " << nbytes << " bytes, " << dtype_name(a.dtype) << ") but rank "
        << a.peer << " sent (tag=" << it->a.tag << ", " << it->buf.size() << " bytes, "
        << dtype_name(it->a.dtype) << ")";
      tp_.fail(ErrorKind::mismatch, m.str());
    }
    if (nbytes) std::memcpy(a.out, it->buf.data(), nbytes);
    st.erase(it);
    op.started = true;
    op.nchunks = op.done = 1;
    return 1;
  }
  return 0;
}

// Starts copying the message at the head of `peer`'s channel into the stash unless a recv of
// the batch wants it (it takes it next round); false if nothing was stashed.
bool Communicator::stash_head(int peer, const std::vector<P2P>& ops) {
  const uint64_t head = recv_chunk_[size_t(peer)];
  if (rx_busy_[size_t(peer)] ||
      seg_->pair_posted(peer, rank_)->v.load(std::memory_order_acquire) < head + 1)
    return false;
  PairSlotHeader h;
  std::memcpy(&h, seg_->pair_slot(peer, rank_, head), sizeof h);
  for (const auto& op : ops)
    if (op.a->coll == Coll::recv && !op.started &&
        (op.a->peer == peer || op.a->peer == kAnySource) && op.a->tag == h.tag)
      return false;
  const DType dt = h.dtype < uint32_t(DType::kCount) ? DType(h.dtype) : DType::u8;
  Stash& e = stash_[size_t(peer)].emplace_back();
  e.a.coll = Coll::recv;
  e.a.peer = peer;
  e.a.tag = h.tag;
  e.a.dtype = dt;
  e.a.count = int64_t(h.nbytes / dtype_size(dt));
  e.a.timeout_s = opt_.timeout_s;
  e.buf.resize(size_t(h.nbytes));
  e.a.out = e.buf.data();
  p2p_step(e.p);  // claims the channel (rx_busy_) before anyone else looks at it
  return true;
}

void Communicator::p2p_done(P2P& op, ErrorKind kind, const std::string& msg,
                            const std::shared_ptr<const std::string>& flight) {
  if (op.started)
    recorded(*op.a, op.rec, op.msg, "", op.t0, p2p_idle_ns_ - op.idle0, kind == ErrorKind::none);
  if (!op.task) return;
  pending_.fetch_sub(1, std::memory_order_acq_rel);
  op.task->finish(kind, msg, flight);
}

bool Communicator::p2p_round(std::vector<P2P>& ops, bool in_wait) {
  bool progressed = false;
  p2p_busy_.assign(2 * size_t(size_), 0);
  auto complete = [](const P2P& op) { return op.started && op.done == op.nchunks; };
  for (size_t i = 0; i < ops.size();) {
    P2P& op = ops[i];
    if (in_wait && (op.ext || complete(op))) {
      ++i;
      continue;
    }
    if (op.ext) {  // a stepped one (Task::step): its own transport, never waited for here
      const bool any = op.a->peer == kAnySource;
      int r;
      {
        InsideBody inside(this, op.task.get());  // it may ask ready_source
        r = (*op.ext)(*op.a);
      }
      if (r == Task::kStepDone) {
        progressed = true;
        p2p_done(op, ErrorKind::none, "", nullptr);
        ops.erase(ops.begin() + long(i));
        continue;
      }
      if (r != Task::kStepLocal) {
        ++i;
        continue;
      }
      if (op.a->peer < 0 || op.a->peer >= size_ || op.a->peer == rank_)
        throw PlaitError("rank " + std::to_string(rank_) + ": a stepped " + coll_name(op.a->coll) +
                         " turned to a peer of no rank here (" + std::to_string(op.a->peer) + ")");
      op.ext = nullptr;  // from here on this communicator's own send/recv
      op.any = any;
      progressed = true;
    }
    // an earlier call on the same channel goes first; async recvs pick messages by tag
    const bool by_tag = op.a->coll == Coll::recv && (op.task || op.any || op.a->peer == kAnySource);
    if (!by_tag) {
      uint8_t& b = p2p_busy_[size_t(op.a->peer) * 2 + (op.a->coll == Coll::send)];
      if (b) {
        ++i;
        continue;
      }
      b = 1;
    }
    while (!complete(op) && p2p_step(op)) progressed = true;
    if (complete(op) && !in_wait) {
      p2p_done(op, ErrorKind::none, "", nullptr);
      ops.erase(ops.begin() + long(i));
    } else {
      ++i;
    }
  }
  // A head message no async recv of this batch took goes aside; stashed ones keep arriving.
  for (auto& op : ops) {
    // (blocking recvs from one sender keep the strict order; from any sender they match by tag)
    if (op.ext || !(op.task || op.any || op.a->peer == kAnySource) || op.a->coll != Coll::recv ||
        op.started)
      continue;
    for (int p = 0; p < size_; ++p)
      if ((p == op.a->peer || (op.a->peer == kAnySource && p != rank_)) && stash_head(p, ops))
        progressed = true;
  }
  for (auto& st : stash_)
    for (auto& e : st)
      while (!complete(e.p) && p2p_step(e.p)) progressed = true;
  return progressed;
}

bool Communicator::other_task_next() {
  std::lock_guard<std::mutex> lk(q_mu_);
  if (queue_.empty()) return false;
  return !queue_.front()->batched();
}

// The transport's idle hook: while a collective or closure waits, the send/recv parked for it
// keep moving, so a peer blocked in a send to this rank (or waiting for a recv's chunks) gets to
// the same collective: irecv, allreduce, wait on one rank and allreduce, send on the other is a
// legal program (MPI's progress rule), which waiting for the allreduce alone would deadlock.
// p2p_round never waits, so this cannot re-enter; a mismatch it finds aborts the communicator
// and the waiting call reports it.
void Communicator::progress_parked() {
  if (!parked_.empty()) p2p_round(parked_, /*in_wait=*/true);
}

void Communicator::run_p2p(std::vector<P2P>& ops) {
  const double t0 = now_s();
  for (auto& op : ops)
    if (op.deadline == 0) op.deadline = t0 + op.a->timeout_s;
  Backoff backoff(policy_);
  // A failed health check is acted on only after one more progress round finds nothing: the
  // peer may have delivered (or taken) the message and left since the last round.
  bool unhealthy = false;
  ErrorKind bad_kind = ErrorKind::none;
  std::string bad_msg;
  try {
    while (!ops.empty()) {
      tp_.throw_if_aborted();
      bool progressed = p2p_round(ops, /*in_wait=*/false);
      if (ops.empty() || !ops.front().task) {
        if (ops.empty()) break;
      } else {  // absorb send/recv queued behind this batch
        std::lock_guard<std::mutex> lk(q_mu_);
        while (!queue_.empty() && queue_.front()->batched()) {
          ops.push_back(op_of(queue_.front()));
          ops.back().deadline = now_s() + queue_.front()->args.timeout_s;
          queue_.pop_front();
        }
      }
      if (!progressed) {
        if (ops.front().task && other_task_next()) {
          // Nothing moves and a collective (or closure) waits behind: it runs now, moving these
          // in its waits (progress_parked); progress_loop resumes them after it.
          parked_ = std::move(ops);
          ops.clear();
          break;
        }
        if (unhealthy) tp_.fail(bad_kind, bad_msg);
        const P2P& first = ops.front();
        if (!first.ext) flight_.waiting(first.a->peer, FlightWait::p2p, first.first + first.done);
        const uint64_t idle_from = trace_ ? mono_ns() : 0;
        backoff.idle([&](double t) {
          for (auto& op : ops) {
            if (op.ext) continue;  // keeps its own deadline and looks at its own peers
            tp_.set_deadline(op.deadline, op.a, "");
            if (!unhealthy && op.a->peer != kAnySource &&
                !tp_.healthy(t, op.a->peer, &bad_kind, &bad_msg))
              unhealthy = true;
          }
        });
        if (trace_) p2p_idle_ns_ += mono_ns() - idle_from;
      } else {
        backoff.reset();
        unhealthy = false;
      }
    }
    flight_.waited();
  } catch (const PlaitError& e) {
    const bool inline_call = ops.empty() || !ops.front().task;
    std::string msg = e.what();
    for (auto& op : ops) {  // failed in the records before the report reads them
      if (op.started) recorded(*op.a, op.rec, op.msg, "", op.t0, p2p_idle_ns_ - op.idle0, false);
      op.started = false;
    }
    // An inline call's report is made by rethrow(), with the rest of its error handling.
    auto flight = inline_call ? nullptr : annotate(e.kind(), &msg);
    for (auto& op : ops) p2p_done(op, e.kind(), msg, flight);
    if (inline_call) throw;
  }
}

}  // namespace plait
