// PLAIT_TRACE=DIR: every call of every communicator of this process as one "X" slice of a
// Chrome / Perfetto trace (trace event format), one file per rank: DIR/trace-rank<R>-<pid>.json.
// Slices are kept in process memory and appended to the file every kFlushEvents calls and at
// finalize / exit, so a long run loses nothing and the file is complete JSON after each flush.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace plait {

struct TraceEvent {
  uint64_t start_ns, end_ns, wait_ns, call;
  int64_t count, tag;
  int32_t root;  // root of broadcast/reduce, peer of send/recv, else -1
  uint8_t coll, dtype, op;
  bool ok;
  const char* algo;  // static storage (the algorithm table's names)
};

class Trace {
 public:
  // Null unless PLAIT_TRACE names a directory.
  static std::unique_ptr<Trace> from_env(int rank, int size);
  ~Trace();
  void add(const TraceEvent& e);
  void set_label(const std::string& label);
  void flush();
  static void flush_all();  // at interpreter exit (plait's atexit hook)

 private:
  Trace(std::string dir, int rank, int size);
  std::mutex mu_;
  std::string dir_, label_;
  int rank_, size_, tid_;
  bool named_ = false;
  std::vector<TraceEvent> buf_;
};

}  // namespace plait
