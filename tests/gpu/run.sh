#!/usr/bin/env bash
# The GPU check in one script (for a machine with a GPU; about 5-10 minutes on one H200):
# builds plait with PLAIT_CUDA=ON, runs the GPU tests (marker cuda; every collective, incl.
# broadcast/reduce/alltoall/send/recv in test_gpu_rooted_p2p.py) and the CPU-side GPU tests,
# runs a short `plait-bench --device cuda` sweep (plait ring/tree vs nccl over NCCL, plait
# one_shot/two_shot/ring over CUDA IPC with two ranks on one GPU) and prints a summary.
# Results also land in $OUT (default build/gpu-results). Exit status: 0 only if all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/gpu-results}
mkdir -p "$OUT"
JOBS=${JOBS:-$(nproc)}
status=0

gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
echo "== build (PLAIT_CUDA=ON)"
t0=$(date +%s)
cmake -S . -B build/gpu "${gen[@]}" -DPLAIT_CUDA=ON \
      -Dpybind11_DIR="$(python -c 'import pybind11; print(pybind11.get_cmake_dir())')" >"$OUT/cmake.log" 2>&1 \
  && cmake --build build/gpu -j "$JOBS" >"$OUT/build.log" 2>&1 \
  || { echo "build failed:"; tail -30 "$OUT/cmake.log" "$OUT/build.log"; exit 1; }
so=$(ls build/gpu/_C*.so)
cp "$so" "python/plait/.$(basename "$so").new" && mv "python/plait/.$(basename "$so").new" "python/plait/$(basename "$so")"
echo "built in $(( $(date +%s) - t0 )) s"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
python -c "import plait; print('build_info:', plait.build_info())" | tee "$OUT/build_info.txt"
ndev=$(python -c "import plait; print(plait.build_info()['cuda_devices'])")

echo "== GPU tests"
python -m pytest -q -rs tests/gpu tests/test_cuda_cpu.py 2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU bench"
bench() {  # ranks, then plait-bench arguments
  local n=$1; shift
  timeout 300 python -m plait.bench --device cuda -n "$n" -c allreduce,reduce_scatter,allgather \
      -b 4K -e 64M -f 16 --trials 3 -w 2 "$@" 2>&1 | tee -a "$OUT/bench.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
: >"$OUT/bench.txt"
bench 1  # NCCL transport: nccl vs plait's ring/tree (a world of one: the path, not the wire)
bench 2 -e 16M  # two ranks on one GPU: CUDA IPC transport (every IPC algorithm); NCCL refuses this
if [ "$ndev" -ge 2 ]; then bench "$(( ndev < 4 ? ndev : 4 ))"; fi  # a GPU per rank: nccl vs ring/tree

echo "== summary"
echo "devices: $ndev; tests: $(grep -E '(passed|failed|error)' "$OUT/tests.txt" | tail -1)"
grep -E '^ *(allreduce|reduce_scatter|allgather) ' "$OUT/bench.txt" | sort -k1,1 -k2,2n -s || true
echo "status: $status"
exit $status
