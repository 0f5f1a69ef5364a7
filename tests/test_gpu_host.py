"""The GPU path's logic executed on the CPU: plait's stream queue, NCCL and CUDA IPC transports and
GPU algorithms, unchanged, compiled against a fake CUDA runtime and a fake NCCL (tests/gpu_host/:
streams are executor threads, device memory is host memory, ranks are threads), then run with
closed-form checks, the second GPU review's findings 1-4, and the IPC protocol under random delays
and a stalled rank. Needs only g++ and the CUDA headers (for the types); objects are cached by
content under PLAIT_CACHE_DIR, so only the first run pays the compile.
"""

import concurrent.futures
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = os.path.join(ROOT, "tests", "gpu_host")
# The queue, transports and algorithms with what they link against (the host algorithms come
# with the one algorithm table); the .cu files are replaced by tests/gpu_host/fake_kernels.cc.
CSRC = [
    "core/types.cc",
    "core/errors.cc",
    "core/device.cc",
    "core/validate.cc",
    "core/watchdog.cc",
    "cuda/stream_queue.cc",
    "transport/nccl.cc",
    "transport/cuda_ipc.cc",
    "transport/table.cc",
    "transport/shared_mem.cc",
    "reduce/reduce_cpu.cc",
]


def cuda_include():
    """The directory holding cuda_runtime_api.h, or None."""
    cands = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "include"))
    cands.append("/usr/local/cuda/include")
    return next((d for d in cands if os.path.exists(os.path.join(d, "cuda_runtime_api.h"))), None)


def build(flags=(), name="gpu_host_tests"):
    """Compiles (in parallel, cached by content) and links the host test binary; returns its path."""
    inc = cuda_include()
    if inc is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h): the fakes need CUDA's types")
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    sources = [os.path.join(ROOT, "csrc", s) for s in CSRC]
    sources += sorted(glob.glob(os.path.join(ROOT, "csrc", "algo", "*.cc")))
    sources += sorted(glob.glob(os.path.join(HOST, "*.cc")))
    headers = sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True))
    headers += sorted(glob.glob(os.path.join(HOST, "*.h")))
    cmd = ["g++", "-std=c++17", "-O1", "-pthread", "-DPLAIT_WITH_CUDA=1", *flags]
    cmd += ["-I" + os.path.join(ROOT, "csrc"), "-I" + HOST, "-I" + inc]
    common = hashlib.sha256(" ".join(cmd).encode())
    for h in headers:
        common.update(h.encode() + open(h, "rb").read())
    cache = os.path.join(
        os.environ.get("PLAIT_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "plait-cache"), "gpu_host"
    )
    os.makedirs(cache, exist_ok=True)

    def obj(src):
        h = common.copy()
        h.update(open(src, "rb").read())
        out = os.path.join(cache, hashlib.sha256(h.digest() + src.encode()).hexdigest()[:24] + ".o")
        if not os.path.exists(out):
            tmp = out + f".{os.getpid()}.tmp"
            r = subprocess.run([*cmd, "-c", src, "-o", tmp], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"compiling {os.path.relpath(src, ROOT)}:\n{r.stderr[-4000:]}"
            os.replace(tmp, out)
        return out

    with concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as ex:
        objs = list(ex.map(obj, sources))
    key = hashlib.sha256("".join(objs).encode()).hexdigest()[:16]
    exe = os.path.join(cache, f"{name}-{key}")
    if not os.path.exists(exe):
        tmp = exe + f".{os.getpid()}.tmp"
        r = subprocess.run(
            ["g++", "-pthread", *flags, *objs, "-o", tmp], capture_output=True, text=True, timeout=600
        )
        assert r.returncode == 0, "linking:\n" + r.stderr[-4000:]
        os.replace(tmp, exe)
    return exe


def run(exe, *tests, timeout=120, env=None):
    r = subprocess.run(
        [exe, *tests], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert r.returncode == 0, f"{' '.join(tests)}:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    assert sorted(ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("ok ")) == sorted(tests), (
        r.stdout
    )
    return r.stdout


@pytest.fixture(scope="module")
def exe():
    return build()


def test_nccl_algorithms_give_the_closed_forms(exe):
    """ring, tree and NCCL's rows for every collective, worlds of 1..5, counts 0/1/13/301 with
    64-byte chunks (many rounds, empty blocks), in place and out, int32 sum, float32 avg (ring
    and tree: sum, then one division, as the CPU path), int64 max, fp16 sum and avg by ring and
    tree (float32 partials, one rounding); finalize destroys every
    communicator and nothing is aborted."""
    run(exe, "nccl_algorithms")


@pytest.mark.parametrize(
    "case",
    [
        "watchdog_leaves_captures_alone",  # finding 1
        "error_inside_a_group_closes_it",  # finding 2
        "per_thread_stream_is_relayed",  # finding 3
        "abort_meeting_the_call_lock_is_not_lost",  # finding 4
    ],
)
def test_review_finding(exe, case):
    run(exe, case)


def test_reduction_element_functions_match_the_cpu_bitwise(exe):
    """reduce_cuda.cu's arithmetic per element (reduce/reduce_elem.h, __host__ __device__) against
    the CPU kernels, bitwise: f16/bf16/f32/f64/int8/uint8/int32/int64 x sum/prod/min/max, avg over
    1/2/3/7 (sum, then divide, as the CPU) and bool or/and over every pair of edge values (NaN,
    inf, signed zeros, limits, wrap-around)."""
    run(exe, "element_functions_match_the_cpu")


def test_reduction_element_functions_with_float32_partials(exe):
    """n-source reductions (3, 4, 6 sources) through the element functions against the CPU kernel
    bit for bit: f16/bf16 accumulate in float32 and round once, sources and results as float32
    partials in every pattern, every op, avg over 3 and 8; eight fp16 ranks at 1e4 average to 1e4
    although their sum is past fp16's range."""
    run(exe, "element_functions_float32_partials")


def test_ipc_protocol_over_threads(exe):
    """Mixed one_shot/two_shot/ring sequences of allreduce (int32 sum, float32 avg whose sum is
    no multiple of 3: divided once, after the sum), reduce_scatter and allgather, worlds of 1..4,
    random counts over 4 KiB staging, in place and out, random delays in every kernel."""
    run(exe, "ipc_protocol")


def test_ipc_half_sums_round_once(exe):
    """fp16 sum and avg over 3 and 4 ranks by one_shot, two_shot and ring: float32 partials
    between ranks (the ring's slots), one rounding, the CPU's result; 30000s average to 30000."""
    run(exe, "ipc_half_partials")


def test_ipc_gives_up_on_a_stalled_peer(exe):
    run(exe, "ipc_peer_stops")


def _tsan_works():
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cc")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        r = subprocess.run(["g++", "-fsanitize=thread", src, "-o", os.path.join(d, "t")], capture_output=True)
        return r.returncode == 0 and subprocess.run([os.path.join(d, "t")]).returncode == 0


def test_ipc_protocol_and_queue_under_thread_sanitizer():
    """The same IPC sequences and the lock-race test under ThreadSanitizer: the protocol's
    epochs and flags, the queue's locks and the watchdog thread, with every access checked."""
    if shutil.which("g++") is None or not _tsan_works():
        pytest.skip("g++ here cannot build and run -fsanitize=thread programs")
    exe = build(("-fsanitize=thread", "-g"), name="gpu_host_tests_tsan")
    run(
        exe,
        "ipc_protocol",
        "abort_meeting_the_call_lock_is_not_lost",
        timeout=300,
        env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0"},
    )


def test_nccl_abi_matches_the_wheels_header():
    """csrc/cuda/nccl_abi.h (plait's own declarations of the NCCL it dlopens) against the real
    nccl.h of the nvidia-nccl-cu13 wheel: values, struct layout, signatures (0.3 s of g++). CI's
    build runs in pip's isolated environment, where cmake finds no nccl.h, so this is the check."""
    inc = cuda_include()
    if inc is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h)")
    if importlib.util.find_spec("nvidia") is None or importlib.util.find_spec("nvidia.nccl") is None:
        pytest.skip("nvidia-nccl-cu13 is not installed (pip install '.[test]' brings it)")
    import nvidia.nccl

    nccl_inc = os.path.join(list(nvidia.nccl.__path__)[0], "include")
    header = os.path.join(nccl_inc, "nccl.h")
    assert os.path.exists(header), f"the wheel has no {header}"
    src = os.path.join(ROOT, "csrc", "cuda", "nccl_abi_check.cc")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-I" + os.path.join(ROOT, "csrc"), "-I" + inc]
    r = subprocess.run([*cmd, "-I" + nccl_inc, src], capture_output=True, text=True, timeout=120)
    version = next(ln.split()[2] for ln in open(header) if ln.startswith("#define NCCL_VERSION_CODE"))
    assert r.returncode == 0, f"nccl_abi.h differs from NCCL {version}'s nccl.h:\n{r.stderr[-4000:]}"
