#!/usr/bin/env bash
# The GPU check in one script, for one short lease of a GPU machine (about 8 minutes of a 16-core,
# one-H200 machine, cold start included): the most evidence per second, under BUDGET_S (default
# 480 s; call it with timeout_s ~560 so a warm follow-up call fits).
#   1. preflight: nvidia-smi (driver, compute mode, MIG), kernel, python/torch/nccl/cupy versions;
#   2. build (PLAIT_CUDA=ON, -lineinfo); then a GATE: a build without CUDA or a process that sees no
#      device stops the run with FATAL (every GPU test would skip and the run could look green);
#      the device is probed once (PLAIT_GPU_PROBE) and PLAIT_GPU_REQUIRED=1 makes a missing device
#      an error in every test process;
#   3. stages ordered by evidence per second, each capped and all inside the budget: kernels,
#      compute-sanitizer memcheck on them, every world-of-one test in parallel (pytest -n 4 when
#      xdist is there), the hand-off micro-benchmark (IPC one_shot at n=2/4, NCCL enqueue cost),
#      IPC values, missing peer (two variants), IPC sweeps, the bench (plait's algorithms and
#      NCCL's own side by side), the CPU tests of the GPU path last;
#   4. a stage that overruns gets its hung ranks' native (gdb) and Python (faulthandler) stacks
#      dumped into its log before it is killed;
#   5. if >= 40 s are left and MPS starts: the hand-off again under MPS (finding 11's remedy);
#   6. the compact table LAST (output tails keep the end) and $OUT/rerun.txt, the failed test ids:
#      `RERUN=1 tests/gpu/run.sh` reruns only those, with NCCL_DEBUG=INFO, without rebuilding.
# Everything lands in $OUT (default build/gpu-results). Exit status: 0 only if every stage passed;
# 3 on the gate.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-results}
mkdir -p "$OUT"
LOGS=build/gpu-logs
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}
RERUN=${RERUN:-0}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PLAIT_GPU_TEST_TIMEOUT=${PLAIT_GPU_TEST_TIMEOUT:-90}
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
START=$SECONDS
status=0
declare -a STAGES=()
(( RERUN )) || { rm -rf "$LOGS"; }
mkdir -p "$LOGS"

left() { echo $(( BUDGET_S - (SECONDS - START) )); }
group() { case $1 in t_*|mps_*|handoff*) echo tests;; bench_*) echo bench;; *) echo setup;; esac; }

# Native and Python stacks of every process below $1 (a stage about to be killed).
dump_stacks() {
  local pids; pids=$(pgrep -P "$1"; for p in $(pgrep -P "$1"); do pgrep -P "$p"; done)
  for p in $pids; do
    echo "==== stacks of pid $p: $(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | cut -c1-160)"
    command -v gdb >/dev/null && timeout 10 gdb -p "$p" -batch -ex "thread apply all bt 20" 2>/dev/null |
      grep -E "^(Thread|#)" | head -80
    kill -ABRT "$p" 2>/dev/null  # PYTHONFAULTHANDLER=1: Python stacks of every thread
  done
}

# stage NAME SECONDS CMD...: CMD under min(SECONDS, budget left); output in $LOGS/NAME.log,
# appended to $OUT/{setup,tests,bench}.log once it ends (a killed run returns what finished).
stage() {
  local name=$1 want=$2; shift 2
  local t; t=$(left); (( t > want )) && t=$want
  if (( t < 10 )); then STAGES+=("$name|skipped (budget spent)|0|"); status=1; return 1; fi
  local t0=$SECONDS
  echo "[$(( SECONDS - START ))s] $name (limit ${t}s)"
  "$@" >"$LOGS/$name.log" 2>&1 &
  local pid=$! rc
  ( sleep $(( t > 20 ? t - 10 : t )); kill -0 $pid 2>/dev/null && { dump_stacks $pid >>"$LOGS/$name.log" 2>&1; sleep 3; kill -TERM -- $pid 2>/dev/null; pkill -TERM -P $pid; } ) &
  local watcher=$!
  wait $pid; rc=$?
  kill $watcher 2>/dev/null; wait $watcher 2>/dev/null
  (( SECONDS - t0 >= t - 10 && rc != 0 )) && rc=124
  { echo "==== $name (rc $rc, $(( SECONDS - t0 )) s)"; cat "$LOGS/$name.log"; } >>"$OUT/$(group "$name").log"
  local res=ok; (( rc == 124 )) && res="TIMED OUT (${t}s)"; (( rc != 0 && rc != 124 )) && res="failed (rc $rc)"
  (( rc != 0 )) && status=1
  local counts; counts=$(grep -E "[0-9]+ (passed|failed|error)" "$LOGS/$name.log" | tail -1 | tr -d '=' | sed 's/ in [0-9.]*s.*//')
  STAGES+=("$name|$res|$(( SECONDS - t0 ))|$counts")
  grep -hE "^(FAILED|ERROR) " "$LOGS/$name.log" | sed -E 's/^(FAILED|ERROR) //; s/ - .*//' >>"$LOGS/failed.txt"
  return $rc
}

if (( ! RERUN )); then
  stage preflight 60 bash -c "nvidia-smi; nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current,memory.total --format=csv; \
    uname -r; $PY -c 'import sys, sysconfig, os; print(sys.version); \
print(\"Python.h:\", os.path.exists(os.path.join(sysconfig.get_paths()[\"include\"], \"Python.h\"))); \
import importlib.metadata as m; [print(p, m.version(p)) for p in (\"torch\", \"nvidia-nccl-cu13\", \"cupy-cuda13x\", \"numpy\") \
if __import__(\"importlib\").util.find_spec(p.split(\"-\")[0].replace(\"nvidia\", \"nvidia.nccl\") if p != \"cupy-cuda13x\" else \"cupy\")]'"
  PB=$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null)
  stage build 300 bash -c "cmake -S . -B build/gpu -G Ninja -DPLAIT_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_FLAGS=-lineinfo -DPython_EXECUTABLE=$(command -v $PY) -Dpybind11_DIR='$PB' && ninja -C build/gpu -j16" &&
    so=$(ls build/gpu/_C*.so) && cp "$so" "python/plait/.$(basename "$so").new" &&
    mv "python/plait/.$(basename "$so").new" "python/plait/$(basename "$so")"
fi
export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"

# -- the gate: no CUDA build, or no device, stops here, loudly ------------------------------------
probe=$($PY -c "import plait, importlib.util as u; print(int(plait.build_info()['cuda']), plait._C.cuda_device_count(), \
int(u.find_spec('torch') is not None), int(u.find_spec('cupy') is not None))" 2>"$LOGS/probe.err")
$PY -c "import plait; print('build_info:', plait.build_info())" >"$LOGS/build_info.txt" 2>&1
cat "$LOGS/build_info.txt" >>"$OUT/setup.log"
read -r cuda ndev _ _ <<<"${probe:-0 0 0 0}"
if [[ "$cuda" != 1 || "${ndev:-0}" -lt 1 ]]; then
  echo "FATAL: plait build_info cuda=$cuda, CUDA devices visible=$ndev: the GPU tests cannot run (they would all skip)."
  echo "FATAL: $(cat "$LOGS/probe.err" "$LOGS/build.log" 2>/dev/null | grep -iE "error|fatal" | head -5)"
  nvidia-smi -L 2>&1 | head -3
  exit 3
fi
export PLAIT_GPU_PROBE="$probe" PLAIT_GPU_REQUIRED=1

PT=($PY -m pytest -q -rfEs -p no:cacheprovider --durations=10 -o faulthandler_timeout=$(( PLAIT_GPU_TEST_TIMEOUT + 20 )))
PAR=()
$PY -c "import xdist" 2>/dev/null && PAR=(-n 4)
G=tests/gpu
gpu_apps() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>/dev/null | head -5; }

if (( RERUN )); then
  [ -s "$OUT/rerun.txt" ] || { echo "RERUN=1 but $OUT/rerun.txt is empty or missing"; exit 0; }
  mapfile -t ids <"$OUT/rerun.txt"
  : >"$LOGS/failed.txt"
  NCCL_DEBUG=INFO stage t_rerun $(( BUDGET_S - 20 )) "${PT[@]}" "${ids[@]}"
else
  : >"$LOGS/failed.txt"
  stage t_kernels 60 "${PT[@]}" $G/test_gpu_kernels.py
  if command -v compute-sanitizer >/dev/null; then
    stage t_memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 9 --target-processes all \
      "${PT[@]}" $G/test_gpu_kernels.py -x -k "not sweep"
  fi
  stage t_world1 120 "${PT[@]}" "${PAR[@]}" $G/test_gpu_collectives.py $G/test_gpu_torch.py $G/test_gpu_rooted_p2p.py \
    -k "world_of_one or unaligned or refused or capture or one_rank or single"
  echo "after t_world1: $(gpu_apps)" >>"$OUT/tests.log"
  stage handoff 60 bash -c "$PY -m plait.run -n 2 $G/handoff.py ipc 200; $PY -m plait.run -n 4 $G/handoff.py ipc 100; \
    $PY -m plait.run -n 1 $G/handoff.py nccl 2000"
  stage t_values 90 "${PT[@]}" $G/test_gpu_values.py
  stage t_horovod 60 "${PT[@]}" $G/test_gpu_horovod.py
  stage t_missing_peer 60 "${PT[@]}" $G/test_gpu_collectives.py -k "missing_peer and ((one_shot and sync) or (ring and async))"
  stage t_ipc_sweeps 90 "${PT[@]}" $G/test_gpu_collectives.py -k "ipc_ranks_sharing or ipc_ring_small or one_gpu_per_rank"
  echo "after t_ipc_sweeps: $(gpu_apps)" >>"$OUT/tests.log"
  B=($PY -m plait.bench --device cuda -c allreduce -b 8 -e 64M -f 32 --trials 2 -w 1 --time 0.3 -a all)
  stage bench_ipc 60 env PLAIT_GPU_TRANSPORT=ipc "${B[@]}" -n 2 --json "$OUT/bench_ipc.json"
  stage bench_nccl 40 "${B[@]}" -n "$(( ndev >= 2 ? (ndev < 4 ? ndev : 4) : 1 ))" -e 1M --json "$OUT/bench_nccl.json"
  stage bench_vs_nccl 45 $PY -m plait.run -n "$(( ndev >= 2 ? (ndev < 4 ? ndev : 4) : 1 ))" bench/gpu_vs_nccl.py 8,65536,67108864 2
  stage t_cpu 60 "${PT[@]}" "${PAR[@]}" tests/test_cuda_cpu.py tests/test_gpu_host.py
  if (( $(left) >= 40 )) && command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d 2>/dev/null; then
    stage mps_handoff 40 bash -c "$PY -m plait.run -n 2 $G/handoff.py ipc 200; $PY -m plait.run -n 4 $G/handoff.py ipc 100"
    echo quit | nvidia-cuda-mps-control
  fi
fi
sort -u "$LOGS/failed.txt" >"$OUT/rerun.txt"

# -- details first, the compact table last ----------------------------------------------------
{
echo "================ details (full logs: \$OUT/setup.log, tests.log, bench.log) ================"
cat "$LOGS/build_info.txt" 2>/dev/null
grep -hE "warning|error" "$LOGS/build.log" 2>/dev/null | head -10
for f in "$LOGS"/t_*.log; do
  [ -f "$f" ] || continue
  grep -qE "failed|error|Timeout|TIMED|==== stacks" "$f" && { echo "---- $(basename "$f" .log)"; grep -E "^(FAILED|ERROR)|Error|assert|==== stacks" "$f" | cut -c1-240 | head -12; }
  grep -hE "^SKIPPED" "$f" | cut -c1-160 | head -5
done
for f in "$LOGS"/bench_*.log; do [ -f "$f" ] && { echo "---- $(basename "$f" .log)"; grep -vE "^\s*$" "$f" | tail -12; }; done
echo
echo "================ GPU check ($(( SECONDS - START )) s of ${BUDGET_S} s; devices: $ndev; $(date -u +%FT%TZ)) ================"
printf "%-15s %-20s %5s  %s\n" stage result s "passed/failed/skipped"
for s in "${STAGES[@]}"; do IFS='|' read -r n r t c <<<"$s"; printf "%-15s %-20s %5s  %s\n" "$n" "$r" "$t" "$c"; done
grep -h "^handoff" "$LOGS"/handoff.log "$LOGS"/mps_handoff.log 2>/dev/null | sed "s/^/  /"
printf "%-6s %-9s %12s %14s %7s\n" via algorithm "lat@8B(us)" "busbw@64MiB" "#wrong"
for b in ipc nccl; do
  f="$LOGS/bench_$b.log"; [ -f "$f" ] || continue
  awk -v t="$b" '$1=="allreduce" { a=$3; if ($2==8) lat[a]=$4; if ($2==67108864) bw[a]=$6; w[a]+=$7; seen[a]=1 }
    END { for (a in seen) printf "%-6s %-9s %12s %14s %7d\n", t, a, (a in lat ? lat[a] : "-"), (a in bw ? bw[a] : "-"), w[a] }' "$f" | sort -k2
done
grep -hE "^[# ]" "$LOGS/bench_vs_nccl.log" 2>/dev/null | tail -6  # plait vs torch's NCCL, side by side
echo "failed tests: $(wc -l <"$OUT/rerun.txt") (\$OUT/rerun.txt; RERUN=1 tests/gpu/run.sh reruns them)"
echo "status: $status"
} | tee "$OUT/summary.txt"
exit $status
