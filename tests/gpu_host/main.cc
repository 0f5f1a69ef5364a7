// The host tests of the GPU path: `gpu_host_tests [name ...]` runs the named tests (all without
// names) and prints "ok <name> <seconds>" for each; a failure prints FAILED and exits 1.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace host {
void test_nccl_algorithms();
void test_watchdog_leaves_captures_alone();
void test_error_inside_a_group_closes_it();
void test_per_thread_stream_is_relayed();
void test_abort_meeting_the_call_lock_is_not_lost();
void test_ipc_protocol();
void test_ipc_peer_stops();
void test_ipc_half_partials();
void test_element_functions_match_the_cpu();
void test_element_functions_float32_partials();
}  // namespace host

int main(int argc, char** argv) {
  setenv("PLAIT_GPU_WATCHDOG_MS", "1", 1);
  struct Test {
    const char* name;
    void (*fn)();
  };
  const Test tests[] = {
      {"nccl_algorithms", host::test_nccl_algorithms},
      {"watchdog_leaves_captures_alone", host::test_watchdog_leaves_captures_alone},
      {"error_inside_a_group_closes_it", host::test_error_inside_a_group_closes_it},
      {"per_thread_stream_is_relayed", host::test_per_thread_stream_is_relayed},
      {"abort_meeting_the_call_lock_is_not_lost",
       host::test_abort_meeting_the_call_lock_is_not_lost},
      {"ipc_protocol", host::test_ipc_protocol},
      {"ipc_peer_stops", host::test_ipc_peer_stops},
      {"ipc_half_partials", host::test_ipc_half_partials},
      {"element_functions_match_the_cpu", host::test_element_functions_match_the_cpu},
      {"element_functions_float32_partials", host::test_element_functions_float32_partials},
  };
  int ran = 0;
  for (const Test& t : tests) {
    bool wanted = argc == 1;
    for (int i = 1; i < argc; ++i) wanted |= std::strcmp(argv[i], t.name) == 0;
    if (!wanted) continue;
    const auto t0 = std::chrono::steady_clock::now();
    t.fn();
    std::printf("ok %s %.2f\n", t.name,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);
    ++ran;
  }
  if (ran == 0) {
    std::fprintf(stderr, "no test matched\n");
    return 2;
  }
  return 0;
}
