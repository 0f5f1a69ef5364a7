// What the flight recorder adds to one call: FlightRecorder::begin + end (a coarse clock read
// and the record's stores), timed over many calls in one process against the same loop with the
// recorder off (both read CLOCK_MONOTONIC once, as every call does for its deadline). Build and run (numbers in bench/RESULTS.md, "Flight recorder"):
//   g++ -O2 -std=c++17 -Icsrc bench/flight_overhead.cc -o /tmp/flight_overhead && /tmp/flight_overhead
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/flight.h"

using namespace plait;

namespace {

double per_call_ns(FlightRecorder& f, const CallArgs& a, uint64_t n) {
  const uint64_t t0 = mono_ns();
  for (uint64_t i = 0; i < n; ++i) {
    // As Communicator::run does: one clock reading per call, for the deadline (always) and the
    // record's start; the end time from the coarse clock (no trace).
    const uint64_t s = mono_ns();
    const uint64_t rec = f.begin(a, i + 1, 0, s);
    asm volatile("" ::: "memory");  // the call's own work would sit here
    if (f.on()) f.end(rec, true, std::max(coarse_ns(), s), false);
  }
  return double(mono_ns() - t0) / double(n);
}

}  // namespace

int main(int argc, char** argv) {
  const uint32_t slots = 256;
  const uint64_t n = argc > 1 ? strtoull(argv[1], nullptr, 10) : 20000000;
  std::vector<FlightRecord> mem(slots + 1);  // a head line, then the ring
  FlightRecorder on, off;
  on.attach(reinterpret_cast<FlightHead*>(&mem[0]), &mem[1], slots);
  CallArgs a;
  a.coll = Coll::allreduce;
  a.count = 2;
  for (int round = 0; round < 5; ++round) {
    const double base = per_call_ns(off, a, n);
    const double rec = per_call_ns(on, a, n);
    std::printf("round %d: off %.2f ns/call, on %.2f ns/call, recorder %.2f ns/call\n", round, base, rec,
                rec - base);
  }
  return 0;
}
