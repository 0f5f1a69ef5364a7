// Reading the flight recorder: every rank's ring, from the shared segment, trusting nothing.
// A peer may have died mid-write, been frozen, or scribbled over its ring; each field is checked
// against its range before it is used, and a record that fails is reported as not trusted.
#include "core/flight.h"

#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <sstream>
#include <vector>

#include "algo/algo.h"
#include "transport/shm.h"

namespace plait {
namespace {

// FlightRecord's layout without the atomic, so a copy of it is a plain memcpy.
struct RawRecord {
  uint32_t ver;
  uint8_t coll, dtype, op, algo;
  uint8_t transport, state, exact, pad;
  int32_t root;
  uint64_t index, call;
  int64_t count, tag;
  uint64_t start_ns, end_ns;
};
static_assert(sizeof(RawRecord) == sizeof(FlightRecord), "RawRecord mirrors FlightRecord");

const char* kStates[] = {"empty", "running", "ok", "failed", "enqueued"};
const char* kWaits[] = {"arrival", "post", "ack", "p2p"};
const char* kTransports[] = {"shm", "nccl", "ipc"};

// A consistent copy, or false when the owner was writing it (or died doing so).
bool read_record(const FlightRecord& r, RawRecord* out) {
  for (int tries = 0; tries < 4; ++tries) {
    const uint32_t v1 = r.ver.load(std::memory_order_acquire);
    if (!(v1 & 1)) {
      std::memcpy(static_cast<void*>(out), static_cast<const void*>(&r), sizeof *out);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (r.ver.load(std::memory_order_relaxed) == v1) return true;
    }
    sched_yield();
  }
  return false;
}

struct Call {
  RawRecord r;
  const char* algo = "";
};

struct Wait {
  bool on = false;
  int peer = 0;
  FlightWait what = FlightWait::arrival;
  uint64_t step = 0;
};

struct RankView {
  int rank = 0;
  int32_t pid = 0;
  std::string state;
  uint64_t recorded = 0;
  Wait wait;
  std::vector<Call> calls;  // oldest first, trusted ones only
  std::vector<std::string> problems;
  size_t untrusted = 0;
};

// Empty when the record is plausible; else why not.
std::string check(const RawRecord& r, uint64_t want, int n, uint64_t now, const char** algo) {
  std::ostringstream why;
  if (r.index != want) {
    why << "holds index " << r.index << " where " << want << " was expected";
  } else if (r.coll >= uint8_t(Coll::kCount)) {
    why << "collective code " << unsigned(r.coll);
  } else if (r.dtype >= uint8_t(DType::kCount)) {
    why << "dtype code " << unsigned(r.dtype);
  } else if (r.op >= uint8_t(RedOp::kCount)) {
    why << "op code " << unsigned(r.op);
  } else if (r.transport >= uint8_t(FlightTransport::kCount)) {
    why << "transport code " << unsigned(r.transport);
  } else if (r.state == uint8_t(FlightState::empty) || r.state >= uint8_t(FlightState::kCount)) {
    why << "state code " << unsigned(r.state);
  } else if (r.count < 0 || r.count > (int64_t(1) << 56)) {
    why << "count " << r.count;
  } else if (r.start_ns == 0 || r.start_ns > now + 1000000000u) {
    why << "start time " << r.start_ns << " ns is not in the past (now " << now << ")";
  } else if (r.state == uint8_t(FlightState::running) ? r.end_ns != 0 : r.end_ns < r.start_ns) {
    why << "end time " << r.end_ns << " does not fit start " << r.start_ns << " and state "
        << kStates[r.state];
  }
  if (!why.str().empty()) return why.str();
  const Coll c = Coll(r.coll);
  const bool p2p = c == Coll::send || c == Coll::recv;
  const bool rooted = c == Coll::broadcast || c == Coll::reduce;
  if ((p2p || rooted) ? (r.root < 0 || r.root >= n) : r.root != -1) {
    why << (p2p ? "peer " : "root ") << r.root << " for " << coll_name(c) << " on " << n
        << " ranks";
  } else if (r.transport != uint8_t(FlightTransport::shm) ||
             r.state == uint8_t(FlightState::enqueued)) {
    if (r.transport == uint8_t(FlightTransport::shm) || r.state != uint8_t(FlightState::enqueued))
      why << "state " << kStates[r.state] << " on transport " << kTransports[r.transport];
    else if (r.algo == kFlightAlgoAuto || r.algo == kFlightAlgoUnknown)
      *algo = r.algo == kFlightAlgoAuto ? "auto" : "?";
    else if (r.algo >= algorithm_table().size())
      why << "GPU algorithm index " << unsigned(r.algo);
    else
      *algo = algorithm_table()[r.algo].name;
  } else if (!p2p) {
    const auto& algos = algorithms_for(c, kShmCaps);
    if (r.algo >= algos.size())
      why << "algorithm index " << unsigned(r.algo) << " for " << coll_name(c);
    else
      *algo = algos[r.algo]->name;
  }
  return why.str();
}

RankView read_rank(const Segment& seg, int r, uint64_t now) {
  RankView v;
  v.rank = r;
  const int n = seg.params().size;
  const uint32_t slots = seg.flight_slots();
  const FlightHead* h = seg.flight_head(r);
  v.recorded = h->next.load(std::memory_order_acquire);
  const uint64_t w = h->waiting.load(std::memory_order_relaxed);
  if (w & kWaitingBit) {
    const uint64_t what = (w >> 56) & 0x7f, peer = (w >> 40) & 0xffff;
    if (what >= uint64_t(FlightWait::kCount) || peer >= uint64_t(n)) {
      v.problems.push_back("its waiting word " + std::to_string(w) + " names no peer and step");
    } else {
      v.wait.on = true;
      v.wait.what = FlightWait(what);
      v.wait.peer = int(peer);
      v.wait.step = w & ((uint64_t(1) << 40) - 1);
    }
  } else if (w) {
    v.problems.push_back("its waiting word " + std::to_string(w) + " is not a wait");
  }
  const uint64_t k = v.recorded < slots ? v.recorded : slots;
  for (uint64_t i = v.recorded - k; i != v.recorded; ++i) {
    Call c;
    std::string why;
    if (!read_record(seg.flight_ring(r)[i % slots], &c.r))
      why = "was being written (torn)";
    else
      why = check(c.r, i, n, now, &c.algo);
    if (why.empty()) {
      v.calls.push_back(c);
      continue;
    }
    ++v.untrusted;
    if (v.problems.size() < 6) v.problems.push_back("record " + std::to_string(i) + " " + why);
  }
  if (v.untrusted > 6)
    v.problems.push_back("... " + std::to_string(v.untrusted) + " records not trusted in all");
  return v;
}

void json_str(std::ostream& o, const std::string& s) {
  o << '"';
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\')
      o << '\\' << ch;
    else if (ch == '\n')
      o << "\\n";
    else if (ch < 0x20 || ch >= 0x7f)
      o << (ch == '\t' ? "\\t" : "?");
    else
      o << ch;
  }
  o << '"';
}

std::string describe_call(const Call& c) {
  const RawRecord& r = c.r;
  const Coll coll = Coll(r.coll);
  std::ostringstream m;
  const bool gpu = r.transport != uint8_t(FlightTransport::shm);
  m << coll_name(coll) << (gpu ? " (GPU) #" : " #") << r.call;
  if (coll == Coll::send || coll == Coll::recv) {
    m << (coll == Coll::send ? " to rank " : " from rank ") << r.root << " ("
      << dtype_name(DType(r.dtype)) << ", " << r.count << ", tag " << r.tag << ")";
  } else if (coll != Coll::barrier) {
    m << " (" << dtype_name(DType(r.dtype)) << ", " << r.count;
    if (r.root >= 0) m << ", root " << r.root;
    m << ", " << c.algo << (gpu ? std::string(" over ") + kTransports[r.transport] : "") << ")";
  }
  return m.str();
}

std::string describe_wait(const Wait& w) {
  std::ostringstream m;
  switch (w.what) {
    case FlightWait::arrival:
      m << "for rank " << w.peer << " to arrive";
      break;
    case FlightWait::post:
      m << "on rank " << w.peer << " step " << w.step;
      break;
    case FlightWait::ack:
      m << "on rank " << w.peer << " to take step " << w.step;
      break;
    default:
      m << "on rank " << w.peer << " chunk " << w.step;
      break;
  }
  return m.str();
}

// "3.0 s", "12.5 ms", "40 us": ages and durations as people read them.
std::string seconds(double s) {
  char b[32];
  if (s >= 0.1)
    std::snprintf(b, sizeof b, "%.1f s", s);
  else if (s >= 1e-4)
    std::snprintf(b, sizeof b, "%.1f ms", s * 1e3);
  else
    std::snprintf(b, sizeof b, "%.0f us", s * 1e6);
  return b;
}

std::string summary_line(const RankView& v, uint64_t now) {
  std::ostringstream m;
  m << "rank " << v.rank;
  if (v.calls.empty()) {
    m << (v.untrusted ? " has no trustworthy flight record (" + v.problems.front() + ")"
                      : " has recorded no call");
  } else {
    const Call& c = v.calls.back();
    m << " last entered " << describe_call(c) << " at t-"
      << seconds(double(int64_t(now - c.r.start_ns)) * 1e-9);
    const std::string dur = seconds(double(c.r.end_ns - c.r.start_ns) * 1e-9);
    if (c.r.state == uint8_t(FlightState::running))
      m << (v.wait.on ? " and is waiting " + describe_wait(v.wait) : " and is still in it");
    else if (c.r.state == uint8_t(FlightState::ok))
      m << " and finished it" << (c.r.exact ? " in " + dur : "");
    else if (c.r.state == uint8_t(FlightState::enqueued))
      m << " and enqueued it on its GPU stream";
    else
      m << " and failed in it after " << dur
        << (v.wait.on ? ", waiting " + describe_wait(v.wait) : "");
    if (v.untrusted) m << " (" << v.untrusted << " records not trusted)";
  }
  m << " [" << v.state << ", pid " << v.pid << "]";
  return m.str();
}

}  // namespace

FlightReport flight_report(const Segment& seg, int me, const std::string& label,
                           const std::string& error, const std::vector<std::string>& states) {
  const uint64_t now = mono_ns();
  const int n = seg.params().size;
  const uint32_t slots = seg.flight_slots();
  std::ostringstream j, s;
  j << "{\"version\": 1, \"rank\": " << me << ", \"size\": " << n << ", \"pid\": " << getpid()
    << ", \"label\": ";
  json_str(j, label);
  j << ", \"error\": ";
  json_str(j, error);
  j << ", \"enabled\": " << (slots ? "true" : "false") << ", \"slots\": " << slots
    << ", \"now_ns\": " << now << ", \"ranks\": [";
  s << "flight recorder of " << label << " (rank " << me
    << "'s view; e.flight or plait.dump(comm) has the last " << slots << " calls of each rank):";
  for (int r = 0; r < n && slots; ++r) {
    RankView v = read_rank(seg, r, now);
    v.pid = seg.ctl(r)->pid;
    v.state = size_t(r) < states.size() ? states[size_t(r)] : "unknown";
    if (r < 16)
      s << "\n  " << summary_line(v, now);
    else if (r == 16)
      s << "\n  ... " << n - 16 << " more ranks";
    j << (r ? ", " : "") << "{\"rank\": " << r << ", \"pid\": " << v.pid << ", \"state\": ";
    json_str(j, v.state);
    j << ", \"recorded\": " << v.recorded << ", \"waiting\": ";
    if (v.wait.on)
      j << "{\"peer\": " << v.wait.peer << ", \"what\": \"" << kWaits[int(v.wait.what)]
        << "\", \"step\": " << v.wait.step << "}";
    else
      j << "null";
    j << ", \"summary\": ";
    json_str(j, summary_line(v, now));
    j << ", \"untrusted\": " << v.untrusted << ", \"problems\": [";
    for (size_t i = 0; i < v.problems.size(); ++i) {
      j << (i ? ", " : "");
      json_str(j, v.problems[i]);
    }
    j << "], \"calls\": [";
    for (size_t i = 0; i < v.calls.size(); ++i) {
      const RawRecord& c = v.calls[i].r;
      const Coll coll = Coll(c.coll);
      j << (i ? ", " : "") << "{\"index\": " << c.index << ", \"call\": " << c.call
        << ", \"collective\": \"" << coll_name(coll) << "\", \"dtype\": \""
        << dtype_name(DType(c.dtype)) << "\", \"count\": " << c.count << ", \"op\": \""
        << op_name(RedOp(c.op)) << "\", \"root\": " << c.root << ", \"tag\": " << c.tag
        << ", \"algorithm\": \"" << v.calls[i].algo << "\", \"transport\": \""
        << kTransports[c.transport] << "\", \"state\": \"" << kStates[c.state]
        << "\", \"start_ns\": " << c.start_ns << ", \"end_ns\": " << c.end_ns
        << ", \"age_s\": " << double(int64_t(now - c.start_ns)) * 1e-9 << ", \"duration_s\": ";
      if (c.end_ns)
        j << double(c.end_ns - c.start_ns) * 1e-9;
      else
        j << "null";
      j << ", \"end_exact\": " << (c.exact ? "true" : "false");
      j << ", \"text\": ";
      json_str(j, describe_call(v.calls[i]));
      j << "}";
    }
    j << "]}";
  }
  if (!slots) s << "\n  (off: PLAIT_FLIGHT=0 when the communicator was made)";
  j << "], \"summary\": ";
  json_str(j, s.str());
  j << "}";
  return {j.str(), s.str()};
}

void flight_scribble(const Segment& seg, int r, uint64_t seed) {
  const uint32_t slots = seg.flight_slots();
  if (!slots) return;
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&] {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    return x;
  };
  FlightHead* h = seg.flight_head(r);
  h->waiting.store(next(), std::memory_order_relaxed);
  // Records keep their place in the history (index) but get one bad field each, or all bytes
  // random: each of the reader's checks gets its turn.
  for (uint32_t i = 0; i < slots; ++i) {
    auto* raw = reinterpret_cast<RawRecord*>(seg.flight_ring(r) + i);
    switch (next() % 8) {
      case 0:
        raw->coll = uint8_t(Coll::kCount) + uint8_t(next() % 100);
        break;
      case 1:
        raw->dtype = uint8_t(DType::kCount) + uint8_t(next() % 100);
        break;
      case 2:
        raw->root = int32_t(seg.params().size + int(next() % 1000));
        raw->coll = uint8_t(Coll::send);
        break;
      case 3:
        raw->ver |= 1;
        break;
      case 4:
        raw->index = next();
        break;
      case 5:
        raw->start_ns = next() | (uint64_t(1) << 62);
        break;
      case 6:
        raw->algo = 200;
        raw->coll = uint8_t(Coll::allreduce);
        raw->root = -1;
        break;
      default:
        for (size_t b = 0; b < sizeof *raw; b += 8) {
          const uint64_t v = next();
          std::memcpy(reinterpret_cast<char*>(raw) + b, &v, 8);
        }
    }
  }
}

}  // namespace plait
