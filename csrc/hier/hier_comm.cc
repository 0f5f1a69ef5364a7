#include "hier/hier_comm.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "core/wait.h"

namespace plait {

HierLayout::HierLayout(const std::vector<int64_t>& ids, int rank) {
  std::vector<int64_t> order;  // host identities by their lowest rank
  for (int64_t id : ids)
    if (std::find(order.begin(), order.end(), id) == order.end()) order.push_back(id);
  hosts.resize(order.size());
  host_of.resize(ids.size());
  local_of.resize(ids.size());
  for (size_t r = 0; r < ids.size(); ++r) {
    const int hh = int(std::find(order.begin(), order.end(), ids[r]) - order.begin());
    host_of[r] = hh;
    local_of[r] = int(hosts[size_t(hh)].size());
    hosts[size_t(hh)].push_back(int(r));
  }
  h = host_of[size_t(rank)];
  i = local_of[size_t(rank)];
  uniform = true;
  for (const auto& m : hosts) uniform = uniform && m.size() == hosts[0].size();
  if (uniform) {
    const size_t L = hosts[0].size(), H = hosts.size();
    in_order = true;
    for (size_t li = 0; li < L; ++li)
      for (size_t hh = 0; hh < H; ++hh) {
        perm.push_back(hosts[hh][li]);
        in_order = in_order && perm.back() == int(li * H + hh);
      }
  }
}

std::string HierLayout::describe_host(int host) const {
  const auto& m = hosts[size_t(host)];
  std::ostringstream s;
  s << "host " << host << ": local ranks 0.." << m.size() - 1 << " are global ranks [";
  for (size_t k = 0; k < m.size(); ++k) s << (k ? ", " : "") << m[k];
  s << "]";
  return s.str();
}

namespace {
void check_engine(const plait_engine* e, const char* what, int rank, int want_rank, int want_size) {
  std::ostringstream m;
  m << "rank " << rank << ": the " << what << " engine ";
  if (!e) {
    m << "is missing";
  } else if (e->version != PLAIT_ENGINE_VERSION || e->struct_size < PLAIT_ENGINE_MIN_SIZE) {
    m << "is version " << e->version << " (" << e->struct_size << " bytes); plait needs version "
      << PLAIT_ENGINE_VERSION;
  } else if (e->rank != want_rank || e->size != want_size) {
    m << e->name << " group has this rank as " << e->rank << " of " << e->size
      << "; the layout needs " << want_rank << " of " << want_size;
  } else {
    return;
  }
  throw InvalidArgument(m.str());
}
}  // namespace

HierComm::HierComm(std::shared_ptr<Communicator> local, int rank, int size,
                   const std::vector<int64_t>& host_ids, plait_engine* inter, plait_engine* world,
                   double timeout_s, const std::string& label)
    : local_(std::move(local)),
      rank_(rank),
      size_(size),
      lay_((rank >= 0 && rank < size && host_ids.size() == size_t(size))
               ? HierLayout(host_ids, rank)
               : throw InvalidArgument(
                     "rank " + std::to_string(rank) + ": " + std::to_string(host_ids.size()) +
                     " host ids for a communicator of " + std::to_string(size) + " ranks")),
      timeout_s_(timeout_s),
      label_(label) {
  // The engines are ours from here on, whatever goes wrong.
  std::unique_ptr<EngineGroup> keep_world, keep_inter;
  std::vector<int> all(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) all[size_t(r)] = r;
  std::vector<int> members;
  const bool member = lay_.uniform || lay_.i == 0;
  for (const auto& m : lay_.hosts) members.push_back(m[lay_.uniform ? size_t(lay_.i) : 0]);
  const std::string name = lay_.uniform ? "shard" + std::to_string(lay_.i) : "leaders";
  if (world) keep_world.reset(new EngineGroup(world, "world", all));
  if (inter) keep_inter.reset(new EngineGroup(inter, name, members));
  if (!(timeout_s >= 0))
    throw InvalidArgument("rank " + std::to_string(rank) +
                          ": timeout must be a number of seconds >= 0");
  if (!local_ || local_->size() != int(lay_.hosts[size_t(lay_.h)].size()) ||
      local_->rank() != lay_.i)
    throw InvalidArgument("rank " + std::to_string(rank) +
                          ": the local communicator does not match the layout (" +
                          lay_.describe_host(lay_.h) + ")");
  check_engine(world, "world", rank, rank, size);
  if (member)
    check_engine(inter, "inter-host", rank, lay_.h, lay_.nhosts());
  else if (inter)
    throw InvalidArgument("rank " + std::to_string(rank) +
                          ": only a host's leader has an inter-host group in the leaders layout");
  const char* chk = getenv("PLAIT_HIER_CHECK");
  check_ = !(chk && std::string(chk) == "0");
  const char* adaptive = getenv("PLAIT_HIER_FRAME_ADAPT");
  adaptive_ = !(adaptive && std::string(adaptive) == "0");
  if (const char* pb = getenv("PLAIT_HIER_PIECE_BYTES"); pb && *pb) {
    const unsigned long long v = std::strtoull(pb, nullptr, 10);
    piece_log2_ = 0;
    if (v) {
      while (piece_log2_ < 30 && (1ull << (piece_log2_ + 1)) <= v) ++piece_log2_;
      piece_log2_ = std::max(piece_log2_, 12);
    }
  }
  world_ = std::move(keep_world);
  inter_ = std::move(keep_inter);
}

HierComm::~HierComm() { finalize(); }

std::string HierComm::head(const CallArgs& a) const {
  std::ostringstream m;
  m << "rank " << rank_ << ": " << coll_name(a.coll);
  if (a.coll != Coll::barrier) m << " (" << dtype_name(a.dtype) << " x " << a.count << ")";
  return m.str();
}

void HierComm::raise_aborted() const {
  std::lock_guard<std::mutex> lk(mu_);
  throw PlaitError("communicator aborted after an earlier error: " + first_error_);
}

std::shared_ptr<Task> HierComm::call(Coll c, const Buffer& in, const Buffer& out, RedOp op,
                                     int root, int peer, int64_t tag, const std::string& algo,
                                     std::optional<double> timeout_s, bool async,
                                     Task::Done on_done) {
  if (closed_)
    throw PlaitError("communicator is finalized; " + std::string(coll_name(c)) +
                     " needs a live one");
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (!first_error_.empty()) {
      lk.unlock();
      raise_aborted();
    }
  }
  const std::string who = "rank " + std::to_string(rank_) + ": " + coll_name(c) + ": ";
  if ((in.present ? in : out).device == Device::cuda) {
    std::shared_ptr<DeviceQueue> q;
    {
      std::lock_guard<std::mutex> lk(dev_mu_);
      q = dev_;
    }
    if (!q)
      fail(ErrorKind::invalid, who +
                                   "GPU arrays need this communicator's GPU transport, which the "
                                   "first GPU call creates on every rank (plait._gpu)");
    if (tag != 0)
      fail(ErrorKind::invalid, who + "tag " + std::to_string(tag) +
                                   ": GPU send/recv have no tags; they match in issue order per "
                                   "pair of ranks (tag=0)");
    // The queue spans every host (NCCL between them): its own errors reach every rank through it.
    // No cross-host fingerprint for GPU calls: comparing them would cost an engine round trip
    // on the host before each enqueue; the queue's watchdog bounds a mismatch by the deadline.
    q->call(c, in, out, op, root, peer, algo, timeout_s.value_or(-1.0),
            [](const CallArgs&, const char*) {});
    return nullptr;
  }
  const bool any = c == Coll::recv && peer == kAnySource;
  if (any && !world_->can_probe())
    fail(ErrorKind::invalid,
         who +
             "a receive from any rank (peer=-1) needs an engine that can "
             "probe for messages; the " +
             std::string(world_->engine()) +
             " engine here cannot (the native MPI engine can, and the native gloo one "
             "unless PLAIT_GLOO_PROBE=0): name the sending rank");
  CallArgs a;
  const std::string why =
      validate_call(c, in, out, op, root, peer, tag, timeout_s.value_or(timeout_s_), rank_, size_,
                    /*any_source=*/any, &a);
  if (!why.empty()) fail(ErrorKind::invalid, why);
  if (!algo.empty() && algo != "auto")
    fail(ErrorKind::invalid, who + "algorithm '" + algo +
                                 "': a multi-host communicator chooses its own steps; pass "
                                 "algorithm='auto'");
  const bool p2p = c == Coll::send || c == Coll::recv;
  if (any && (tag < 0 || tag >= (int64_t(1) << 31)))
    fail(ErrorKind::invalid, who + "tag " + std::to_string(tag) +
                                 " from any rank: a message from another host needs a tag in "
                                 "[0, 2^31)");
  if (p2p && !any && lay_.host_of[size_t(peer)] != lay_.h && (tag < 0 || tag >= (int64_t(1) << 31)))
    fail(ErrorKind::invalid, who + "tag " + std::to_string(tag) + " to rank " +
                                 std::to_string(peer) + " on host " +
                                 std::to_string(lay_.host_of[size_t(peer)]) +
                                 ": between hosts a tag must be in [0, 2^31)");
  if (p2p) return p2p_call(a, async, std::move(on_done));
  Fingerprint fp;
  {
    fp.seq = ++seq_;
    fp.count = a.count;
    fp.root = (c == Coll::broadcast || c == Coll::reduce) ? root : -1;
    fp.coll = uint8_t(c);
    fp.dtype = uint8_t(a.dtype);
    const bool reduces = c == Coll::allreduce || c == Coll::reduce_scatter || c == Coll::reduce;
    fp.op = reduces ? uint8_t(a.op) : 0xFF;
  }
  // Small async calls are left to their waiter, as the local communicator's own are.
  const bool deferred = size_t(a.count) * dtype_size(a.dtype) <= kDeferMaxBytes;
  if (!async) notify_long_wait();  // engines wait on the network: let other Python threads run
  return local_->submit(
      a, [this, a, fp]() mutable { run_call(a, fp); }, async, deferred, std::move(on_done));
}

void HierComm::run_call(CallArgs& a, const Fingerprint& fp) {
  {
    std::unique_lock<std::mutex> lk(mu_);
    if (!first_error_.empty()) {
      lk.unlock();
      raise_aborted();
    }
  }
  const double deadline = now_s() + a.timeout_s;
  try {
    switch (a.coll) {
      case Coll::allreduce:
        allreduce(a, fp, a.in, a.out, deadline);
        break;
      case Coll::reduce: {
        std::vector<uint8_t> scratch;
        void* out = a.out;
        if (rank_ != a.root) {  // a reduce costs an allreduce; the others' result is dropped
          scratch.resize(size_t(a.count) * dtype_size(a.dtype));
          out = scratch.data();
        }
        allreduce(a, fp, a.in, out, deadline);
        break;
      }
      case Coll::reduce_scatter:
        reduce_scatter(a, fp, deadline);
        break;
      case Coll::allgather:
        allgather(fp, static_cast<const uint8_t*>(a.in), static_cast<uint8_t*>(a.out),
                  size_t(a.count) * dtype_size(a.dtype), deadline);
        break;
      case Coll::broadcast:
        broadcast(fp, static_cast<const uint8_t*>(a.in), static_cast<uint8_t*>(a.out),
                  size_t(a.count) * dtype_size(a.dtype), a.root, deadline);
        break;
      case Coll::alltoall:
        alltoall(fp, static_cast<const uint8_t*>(a.in), static_cast<uint8_t*>(a.out),
                 size_t(a.count) * dtype_size(a.dtype), deadline);
        break;
      case Coll::barrier:
        barrier(fp, deadline);
        break;
      default:
        throw InvalidArgument("unknown collective");
    }
    adapt();
  } catch (const PlaitError& e) {
    if (e.kind() == ErrorKind::peer_lost) {
      // A lost engine peer or flag store is often the echo of a failure this host recorded
      // first (the leader saw a mismatch, aborted the segment, and its process exited, taking
      // the engines' store with it): raise that cause, with its kind.
      try {
        local_->throw_if_aborted();
      } catch (const PlaitError& cause) {
        on_error(a, cause);
      }
    }
    on_error(a, e);
  }
}

void HierComm::abort_everywhere(ErrorKind kind, const std::string& msg) {
  local_->abort_all(kind, msg);  // this host's ranks, through the segment
  for (EngineGroup* g : {inter_.get(), world_.get()})
    if (g) g->fail(kind, msg);  // the other hosts, through the engines' job-wide flag
}

void HierComm::on_error(const CallArgs& a, const PlaitError& e) {
  std::string msg = e.what();
  const std::string me = "rank " + std::to_string(rank_) + ": ";
  if (msg.compare(0, me.size(), me) != 0) msg = head(a) + ": " + msg;
  if (!first_failure(e.kind(), msg)) raise_aborted();
  throw_error(e.kind(), msg);
}

bool HierComm::first_failure(ErrorKind kind, const std::string& msg) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!first_error_.empty()) return false;
    first_error_ = msg;
  }
  abort_everywhere(kind, msg);
  return true;
}

void HierComm::fail(ErrorKind kind, const std::string& msg) {
  if (!first_failure(kind, msg)) raise_aborted();
  throw_error(kind, msg);
}

void HierComm::attach_device(std::shared_ptr<DeviceQueue> q) {
  std::lock_guard<std::mutex> lk(dev_mu_);
  if (dev_) throw InvalidArgument("this communicator already has a GPU transport");
  if (!q || q->rank() != rank_ || q->size() != size_)
    throw InvalidArgument("a GPU transport of rank " + std::to_string(rank_) + " of " +
                          std::to_string(size_) + " ranks is needed");
  dev_ = std::move(q);
}

void HierComm::finalize() {
  if (closed_) return;
  closed_ = true;
  local_->finalize();  // runs what is queued first
  inter_.reset();
  world_.reset();
}

void HierComm::set_label(const std::string& label) {
  std::lock_guard<std::mutex> lk(mu_);
  label_ = label;
}

std::string HierComm::label() const {
  std::lock_guard<std::mutex> lk(mu_);
  return label_;
}

}  // namespace plait
