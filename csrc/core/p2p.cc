// send/recv over the per-pair channels of the segment.
// Each ordered pair (src, dst) has two slots of pair_slot_bytes; a message is cut into chunks
// that alternate between them. The sender writes a chunk with its header (message number, tag,
// size, dtype) and bumps `posted`; the receiver checks the header against its own call, copies
// the chunk out and bumps `taken`, which frees the slot. Messages on one pair match in order.
// Several calls progress together so that exchanges (isend+irecv on both sides) cannot deadlock.
#include <cstring>
#include <sstream>

#include "core/communicator.h"

namespace plait {

// Moves one chunk if the channel allows; false when it has to wait.
bool Communicator::p2p_step(P2P& op) {
  const CallArgs& a = *op.a;
  const size_t slot_bytes = seg_->params().pair_slot_bytes;
  const size_t nbytes = size_t(a.count) * dtype_size(a.dtype);
  const bool is_send = a.coll == Coll::send;
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
    if (g >= 2 && seg_->pair_taken(rank_, a.peer)->v.load(std::memory_order_acquire) < g - 1) return false;
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
  }
  ++op.done;
  return true;
}

void Communicator::run_p2p(std::vector<P2P>& ops) {
  const double t0 = now_s();
  for (auto& op : ops) op.deadline = t0 + op.a->timeout_s;
  std::vector<uint8_t> busy(2 * size_t(size_));
  Backoff backoff(policy_);
  // A failed health check is acted on only after one more progress round finds nothing: the
  // peer may have delivered (or taken) the message and left since the last round.
  bool unhealthy = false;
  ErrorKind bad_kind = ErrorKind::none;
  std::string bad_msg;
  auto finish = [&](P2P& op, ErrorKind kind, const std::string& msg,
                    const std::shared_ptr<const std::string>& flight) {
    if (op.started) recorded(*op.a, op.rec, op.msg, "", op.t0, p2p_idle_ns_ - op.idle0, kind == ErrorKind::none);
    if (!op.task) return;
    pending_.fetch_sub(1, std::memory_order_acq_rel);
    op.task->finish(kind, msg, flight);
  };
  try {
    while (!ops.empty()) {
      tp_.throw_if_aborted();
      bool progressed = false;
      std::fill(busy.begin(), busy.end(), 0);
      for (size_t i = 0; i < ops.size();) {
        P2P& op = ops[i];
        uint8_t& b = busy[size_t(op.a->peer) * 2 + (op.a->coll == Coll::send)];
        if (b) {  // an earlier call on the same channel goes first
          ++i;
          continue;
        }
        b = 1;
        while (!(op.started && op.done == op.nchunks) && p2p_step(op)) progressed = true;
        if (op.started && op.done == op.nchunks) {
          finish(op, ErrorKind::none, "", nullptr);
          ops.erase(ops.begin() + long(i));
        } else {
          ++i;
        }
      }
      if (ops.empty() || !ops.front().task) {
        if (ops.empty()) break;
      } else {  // absorb send/recv queued behind this batch
        std::lock_guard<std::mutex> lk(q_mu_);
        while (!queue_.empty() &&
               (queue_.front()->args.coll == Coll::send || queue_.front()->args.coll == Coll::recv)) {
          auto t = queue_.front();
          queue_.pop_front();
          ops.push_back(P2P{&t->args, t});
          ops.back().deadline = now_s() + t->args.timeout_s;
        }
      }
      if (!progressed) {
        if (unhealthy) tp_.fail(bad_kind, bad_msg);
        const P2P& first = ops.front();
        flight_.waiting(first.a->peer, FlightWait::p2p, first.first + first.done);
        const uint64_t idle_from = trace_ ? mono_ns() : 0;
        backoff.idle([&](double t) {
          for (auto& op : ops) {
            tp_.set_deadline(op.deadline, op.a, "");
            if (!unhealthy && !tp_.healthy(t, op.a->peer, &bad_kind, &bad_msg)) unhealthy = true;
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
    for (auto& op : ops) finish(op, e.kind(), msg, flight);
    if (inline_call) throw;
  }
}

}  // namespace plait
