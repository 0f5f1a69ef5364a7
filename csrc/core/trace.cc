#include "core/trace.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "core/types.h"

namespace plait {
namespace {

constexpr size_t kFlushEvents = 256;  // as many as a flight ring holds

// The process's trace file, shared by its communicators (each is one track, tid).
struct File {
  std::recursive_mutex mu;  // flush_all holds it across the traces' own flushes
  std::string path;
  int pid = 0;       // the process the file belongs to (a forked child starts its own)
  bool any = false;  // events written: the next one needs a comma, and the "]" is rewound over
  std::set<Trace*> live;
  int next_tid = 0;
};

File& file() {
  static File* f = new File;  // never destroyed: traces flush at exit after static destructors
  return *f;
}

// RANK from the launcher names the file; a process without one uses the communicator's rank.
int world_rank(int fallback) {
  const char* r = getenv("RANK");
  return r && *r ? atoi(r) : fallback;
}

void json_str(std::ostream& o, const std::string& s) {
  o << '"';
  for (unsigned char c : s) {
    if (c == '"' || c == '\\')
      o << '\\' << c;
    else if (c < 0x20 || c >= 0x7f)
      o << '?';
    else
      o << c;
  }
  o << '"';
}

}  // namespace

std::unique_ptr<Trace> Trace::from_env(int rank, int size) {
  const char* d = getenv("PLAIT_TRACE");
  if (!d || !*d) return nullptr;
  mkdir(d, 0755);  // the last level, as plait-bench --trace does; an error shows as no file
  return std::unique_ptr<Trace>(new Trace(d, rank, size));
}

Trace::Trace(std::string dir, int rank, int size) : dir_(std::move(dir)), rank_(rank), size_(size) {
  File& f = file();
  std::lock_guard<std::recursive_mutex> lk(f.mu);
  tid_ = f.next_tid++;
  label_ = "comm" + std::to_string(tid_);
  f.live.insert(this);
}

Trace::~Trace() {
  flush();
  File& f = file();
  std::lock_guard<std::recursive_mutex> lk(f.mu);
  f.live.erase(this);
}

void Trace::add(const TraceEvent& e) {
  std::unique_lock<std::mutex> lk(mu_);
  buf_.push_back(e);
  if (buf_.size() < kFlushEvents) return;
  lk.unlock();
  flush();
}

void Trace::set_label(const std::string& label) {
  std::lock_guard<std::mutex> lk(mu_);
  label_ = label;
  named_ = false;
}

void Trace::flush() {
  std::vector<TraceEvent> evs;
  std::ostringstream o;
  {
    std::lock_guard<std::mutex> lk(mu_);
    evs.swap(buf_);
    if (evs.empty() && named_) return;
    const int pid = world_rank(rank_);
    auto sep = [&] { o << ",\n"; };
    if (!named_) {
      named_ = true;
      sep();
      o << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << pid
        << ", \"args\": {\"name\": \"rank " << pid << "\"}}";
      sep();
      o << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << pid << ", \"tid\": " << tid_
        << ", \"args\": {\"name\": ";
      json_str(o,
               label_ + " (rank " + std::to_string(rank_) + " of " + std::to_string(size_) + ")");
      o << "}}";
    }
    for (const TraceEvent& e : evs) {
      const Coll c = Coll(e.coll);
      const bool p2p = c == Coll::send || c == Coll::recv;
      const double dur_us = double(e.end_ns - e.start_ns) * 1e-3,
                   wait_us = double(e.wait_ns) * 1e-3;
      sep();
      o << "{\"name\": \"" << coll_name(c)
        << "\", \"cat\": \"plait\", \"ph\": \"X\", \"pid\": " << pid << ", \"tid\": " << tid_
        << ", \"ts\": " << std::fixed << double(e.start_ns) * 1e-3 << ", \"dur\": " << dur_us
        << std::defaultfloat << ", \"args\": {\"call\": " << e.call
        << ", \"bytes\": " << uint64_t(e.count) * dtype_size(DType(e.dtype))
        << ", \"count\": " << e.count << ", \"dtype\": \"" << dtype_name(DType(e.dtype)) << "\"";
      if (p2p)
        o << ", \"peer\": " << e.root << ", \"tag\": " << e.tag;
      else
        o << ", \"algorithm\": \"" << e.algo << "\"";
      if (c == Coll::allreduce || c == Coll::reduce || c == Coll::reduce_scatter)
        o << ", \"op\": \"" << op_name(RedOp(e.op)) << "\"";
      if (c == Coll::broadcast || c == Coll::reduce) o << ", \"root\": " << e.root;
      o << ", \"wait_us\": " << wait_us
        << ", \"data_us\": " << (dur_us > wait_us ? dur_us - wait_us : 0.0)
        << ", \"ok\": " << (e.ok ? "true" : "false") << "}}";
    }
  }
  File& f = file();
  std::lock_guard<std::recursive_mutex> lk(f.mu);
  if (f.pid != getpid()) f.path.clear(), f.any = false, f.pid = getpid();
  if (f.path.empty())
    f.path = dir_ + "/trace-rank" + std::to_string(world_rank(rank_)) + "-" +
             std::to_string(getpid()) + ".json";
  FILE* fp = fopen(f.path.c_str(), f.any ? "r+" : "w");
  if (!fp) return;  // a trace is best effort: no directory, no trace (and no failed calls)
  std::string body = o.str();
  if (f.any) {
    fseek(fp, -2, SEEK_END);  // over the "\n]" that closed the previous flush
  } else {
    body = "[" + body.substr(1);  // the first element needs no comma
  }
  body += "\n]";
  fwrite(body.data(), 1, body.size(), fp);
  fclose(fp);
  f.any = true;
}

void Trace::flush_all() {
  File& f = file();
  std::lock_guard<std::recursive_mutex> lk(f.mu);  // no trace is destroyed meanwhile
  for (Trace* t : f.live) t->flush();
}

}  // namespace plait
