#!/usr/bin/env bash
# The GPU check in one script, for one short lease of a GPU machine (budgeted for ~7 minutes on
# one H200, hard-bounded by BUDGET_S, default 540 s, so it fits a 10-minute window): pre-flight,
# build (PLAIT_CUDA=ON, ninja -j16), the GPU tests fastest first (each stage under its own
# timeout, each spawned test under PLAIT_GPU_TEST_TIMEOUT), then a short bench: allreduce, 8 B ..
# 256 MiB, factor 16, plait's IPC algorithms with two ranks on one GPU and NCCL's (a GPU per rank
# when there are 2+, else a world of one: the call path only). Needs python3, no network.
# Prints a summary table first (tests passed/failed; plait vs nccl latency at 8 B and busbw at
# 256 MiB; the device-copy limit), the details after. Everything lands in $OUT (default
# build/gpu-results) as at most five files (setup.log, tests.log, bench.log, summary.txt; each
# stage is appended once it ends, so a killed run still returns what finished). Exit status: 0
# only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-results}
mkdir -p "$OUT"
LOGS=build/gpu-logs
rm -rf "$LOGS"; mkdir -p "$LOGS"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-540}
export PYTHONUNBUFFERED=1 PLAIT_GPU_TEST_TIMEOUT=${PLAIT_GPU_TEST_TIMEOUT:-90}
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1
START=$SECONDS
status=0
declare -a STAGES=()

left() { echo $(( BUDGET_S - (SECONDS - START) )); }
# stage NAME SECONDS CMD...: runs CMD under min(SECONDS, budget left); its output goes to
# $LOGS/NAME.log, then is appended to $OUT/{setup,tests,bench}.log by the name's prefix.
group() { case $1 in t_*) echo tests;; bench_*) echo bench;; *) echo setup;; esac; }
stage() {
  local name=$1 want=$2; shift 2
  local t; t=$(left); (( t > want )) && t=$want
  if (( t < 10 )); then
    STAGES+=("$name|skipped (budget spent)|0"); status=1; return 1
  fi
  local t0=$SECONDS
  echo "[$(( SECONDS - START ))s] $name (limit ${t}s)"
  timeout -k 5 "$t" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  { echo "==== $name (rc $rc, $(( SECONDS - t0 )) s)"; cat "$LOGS/$name.log"; } >>"$OUT/$(group "$name").log"
  local res="ok"; (( rc == 124 || rc == 137 )) && res="TIMED OUT after ${t}s"; (( rc != 0 && rc != 124 && rc != 137 )) && res="failed (rc $rc)"
  (( rc != 0 )) && status=1
  STAGES+=("$name|$res|$(( SECONDS - t0 ))")
  return $rc
}

stage preflight 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv; \
  $PY -c 'import sys, sysconfig, os; print(sys.version); inc = sysconfig.get_paths()[\"include\"]; \
print(\"Python.h:\", os.path.exists(os.path.join(inc, \"Python.h\"))); import numpy, pybind11, pytest; \
import nvidia.nccl; print(\"nccl wheel ok\"); import torch; print(\"torch\", torch.__version__, torch.cuda.is_available())'"

PB=$($PY -c 'import pybind11; print(pybind11.get_cmake_dir())' 2>/dev/null)
if stage build 300 bash -c "cmake -S . -B build/gpu -G Ninja -DPLAIT_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE=$(command -v $PY) -Dpybind11_DIR='$PB' && ninja -C build/gpu -j16"; then
  so=$(ls build/gpu/_C*.so)
  cp "$so" "python/plait/.$(basename "$so").new" && mv "python/plait/.$(basename "$so").new" "python/plait/$(basename "$so")"
  export PYTHONPATH="$PWD/python:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
  $PY -c "import plait; print('build_info:', plait.build_info())" >"$LOGS/build_info.txt" 2>&1
  cat "$LOGS/build_info.txt" >>"$OUT/setup.log"
  ndev=$($PY -c "import plait; print(plait.build_info()['cuda_devices'])" 2>/dev/null || echo 0)
  PT=($PY -m pytest -q -rfEs -p no:cacheprovider)
  $PY -c "import pytest_timeout" 2>/dev/null && PT+=(--timeout=$(( PLAIT_GPU_TEST_TIMEOUT + 30 )))
  G=tests/gpu
  stage t_kernels 90 "${PT[@]}" $G/test_gpu_kernels.py tests/test_cuda_cpu.py
  stage t_world1 120 "${PT[@]}" $G/test_gpu_collectives.py -k "world_of_one or unaligned or refused"
  stage t_torch_p2p 120 "${PT[@]}" $G/test_gpu_torch.py $G/test_gpu_rooted_p2p.py $G/test_gpu_hier.py
  stage t_values 120 "${PT[@]}" $G/test_gpu_values.py
  stage t_missing_peer 120 "${PT[@]}" $G/test_gpu_collectives.py -k "missing_peer"
  stage t_ipc_sweeps 150 "${PT[@]}" $G/test_gpu_collectives.py -k "ipc_ranks_sharing or ipc_ring_small or one_gpu_per_rank"
  B=($PY -m plait.bench --device cuda -c allreduce -b 8 -e 256M -f 16 --trials 3 -w 1 --time 0.3 -a all)
  stage bench_ipc 120 env PLAIT_GPU_TRANSPORT=ipc "${B[@]}" -n 2
  stage bench_nccl 60 "${B[@]}" -n "$(( ndev >= 2 ? (ndev < 4 ? ndev : 4) : 1 ))"
else
  ndev=0
fi

# -- summary first, details after -----------------------------------------------------------------
{
echo "================ GPU check summary ($(( SECONDS - START )) s of ${BUDGET_S} s; devices: ${ndev:-?}) ================"
printf "%-16s %-28s %6s\n" stage result seconds
for s in "${STAGES[@]}"; do IFS='|' read -r n r t <<<"$s"; printf "%-16s %-28s %6s\n" "$n" "$r" "$t"; done
echo
echo "tests:"
for f in "$LOGS"/t_*.log; do [ -f "$f" ] && printf "  %-16s %s\n" "$(basename "$f" .log)" "$(grep -E '(passed|failed|error|skipped)' "$f" | tail -1)"; done
echo
grep -h "^# copy limit" "$LOGS"/bench_*.log 2>/dev/null | head -1
printf "%-10s %-9s %14s %16s %7s\n" transport algorithm "lat@8B(us)" "busbw@256MiB" "#wrong"
for b in ipc nccl; do
  f="$LOGS/bench_$b.log"; [ -f "$f" ] || continue
  awk -v t="$b" '$1=="allreduce" { a=$3; if ($2==8) lat[a]=$4; if ($2==268435456) bw[a]=$6; w[a]+=$7; seen[a]=1 }
    END { for (a in seen) printf "%-10s %-9s %14s %16s %7d\n", t, a, (a in lat ? lat[a] : "-"), (a in bw ? bw[a] : "-"), w[a] }' "$f" | sort -k2
done
echo "status: $status"
echo
echo "================ details (full logs: \$OUT/setup.log, tests.log, bench.log) ================"
cat "$LOGS/build_info.txt" 2>/dev/null
grep -hE "warning|error" "$LOGS/build.log" 2>/dev/null | head -10
for f in "$LOGS"/t_*.log; do  # failures only: the tail of the report stays within reach
  [ -f "$f" ] || continue
  grep -qE "failed|error|Timeout|TIMED" "$f" && { echo "---- $(basename "$f" .log): failures"; grep -E "^(FAILED|ERROR)|Error|assert" "$f" | head -15; }
done
for f in "$LOGS"/bench_*.log; do [ -f "$f" ] && { echo "---- $(basename "$f" .log)"; grep -vE "^\s*$" "$f" | tail -30; }; done
} | tee "$OUT/summary.txt"
exit $status
