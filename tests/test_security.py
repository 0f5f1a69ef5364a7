"""Shared memory as an attack surface: who may open a segment, which segments plait will attach
to, and what happens when a rank scribbles over the segment while its peers use it."""

import ctypes
import os
import random
import re
import shutil
import stat
import subprocess
import time

import numpy as np
import pytest

import plait
from plait import _comm, _shm
from conftest import run_ranks

SHM = "/dev/shm"


def _path(info):
    return os.path.join(SHM, info["name"].lstrip("/"))


@pytest.fixture
def segment():
    """A 2-rank segment this process created (nobody else has opened it yet)."""
    old = os.umask(0)  # plait must not rely on the caller's umask
    try:
        info = _comm.new_segment_info(2, 8192)
        seg = _comm.create_segment(info)
    finally:
        os.umask(old)
    yield info, seg
    try:
        os.unlink(_path(info))
    except FileNotFoundError:
        pass


def test_segment_is_0600_and_owned(segment):
    info, _ = segment
    st = os.stat(_path(info))
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
    assert st.st_uid == os.geteuid()


def test_names_and_tokens_are_not_derivable_from_the_job():
    """Same job parameters, same process: fresh 128-bit names and tokens each time."""
    infos = [_comm.new_segment_info(4, 8192) for _ in range(64)]
    for info in infos:
        assert re.fullmatch(r"/plait-%d-[0-9a-f]{32}" % os.getpid(), info["name"]), info["name"]
    assert len({i["name"] for i in infos}) == len(infos)
    assert len({tuple(i["token"]) for i in infos}) == len(infos)


# ---------------------------------------------------------------- another user


@pytest.fixture(scope="module")
def other_user():
    if os.geteuid() != 0:
        pytest.skip(
            "needs root to create a throwaway user (useradd); as a normal user the "
            "kernel's 0600 check is what protects the segment, tested above by its mode"
        )
    if not shutil.which("useradd"):
        pytest.skip("no useradd on this machine")
    name = "plaitsec%d" % os.getpid()
    subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/bin/false", name], check=True, capture_output=True
    )
    try:
        out = subprocess.run(["id", "-u", name], check=True, capture_output=True, text=True)
        yield int(out.stdout)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def _as_user(uid, fn):
    """Runs fn() in a child that has become uid; returns what it printed as its outcome."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            msg = "ok: " + str(fn())
        except BaseException as e:  # noqa: BLE001
            msg = "%s: %s" % (type(e).__name__, e)
        os.write(w, msg.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        msg = f.read().decode()
    os.waitpid(pid, 0)
    return msg


def test_other_user_cannot_open_or_attach(segment, other_user):
    info, _ = segment
    got = _as_user(other_user, lambda: _comm.open_segment(info))
    assert got.startswith("PlaitError") and "Permission denied" in got, got
    got = _as_user(other_user, lambda: os.open(_path(info), os.O_RDONLY))
    assert got.startswith("PermissionError"), got


# ---------------------------------------------------------------- stale or foreign segments


def _plant(info, data, mode=0o600):
    fd = os.open(_path(info), os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)


FOREIGN = {
    # case: (how to change the planted segment, what the refusal says)
    "wrong_token": ("token", r"stale or foreign"),
    "garbage": ("garbage", r"stale or foreign"),
    "wrong_size": ("short", r"size"),
    "group_readable": ("mode", r"mode"),
    "other_owner": ("chown", r"belongs to uid"),
}


@pytest.mark.parametrize("case", list(FOREIGN))
def test_stale_or_foreign_segment_is_refused(case, request):
    """A segment under the expected name that is not this job's is refused, and left untouched
    (in particular its attach counter is not bumped)."""
    how, says = FOREIGN[case]
    info = _comm.new_segment_info(2, 8192)
    # A genuine segment of the same shape, created under another token: its bytes are a
    # perfect impostor but for the token.
    twin = dict(info, name=_shm.segment_name(), token=[info["token"][0] ^ 1, info["token"][1]])
    _comm.create_segment(twin)
    with open(_path(twin), "rb") as f:
        image = f.read()
    os.unlink(_path(twin))
    size = len(image)
    data = {"garbage": random.Random(7).randbytes(size), "short": image[: size - 4096]}.get(how, image)
    _plant(info, data, 0o644 if how == "mode" else 0o600)
    try:
        if how == "chown":
            uid = request.getfixturevalue("other_user")
            os.chown(_path(info), uid, -1)
        with pytest.raises(plait.PlaitError, match=says):
            _comm.open_segment(info)
        with open(_path(info), "rb") as f:
            assert f.read() == data, "a refused segment was written to"
    finally:
        os.unlink(_path(info))


def test_create_never_reuses_an_existing_name(segment):
    info, _ = segment
    with pytest.raises(plait.PlaitError, match="File exists"):
        _comm.create_segment(info)


# ---------------------------------------------------------------- garbage in a live segment


def _mapping():
    """(address, bytes) of this process's one plait segment mapping."""
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f if "/dev/shm/plait-" in line]
    assert len(maps) == 1, maps
    lo, hi = (int(v, 16) for v in maps[0][0].split("-"))
    return lo, hi - lo


def _layout(n, staging, pair_slot):
    """Offsets of the segment's parts (csrc/transport/shm.cc, Segment::Segment)."""
    page, ctl = 4096, 320  # sizeof(RankCtl): five 64-byte lines
    up = lambda v: (v + page - 1) // page * page  # noqa: E731
    pair_ctl = page + up(ctl * n)
    staging_off = pair_ctl + up(2 * 64 * n * n)
    pair_data = staging_off + n * staging
    flight = _comm.flight_slots()  # the flight recorder's rings come last
    return {
        "ctl": page,
        "ctl_size": ctl,
        "pair_ctl": pair_ctl,
        "pair_data": pair_data,
        "total": pair_data
        + up(n * n * 2 * (64 + pair_slot))
        + (up(n * (flight + 1) * 64) if flight else 0)
        + up(n * 64 * 32),
    }  # the GPU call prints: kGpuPrints of 32 bytes per rank


def _write(addr, data):
    ctypes.memmove(addr, data, len(data))


def _scribble(rank, n, store, case):
    comm = plait.init(rank, n, store=store, timeout=1.5, buffer_bytes=8192)
    comm.barrier()
    time.sleep(0.3)  # every rank is out of the barrier before rank 1 scribbles
    staging, pair_slot = _comm.segment_params(n, 8192)
    lay = _layout(n, staging, pair_slot)
    base, size = _mapping()
    assert size == lay["total"], (size, lay)
    rng = random.Random(99)
    if rank == 1:
        if case == "abort_record":  # an abort kind out of range and a message with no end
            _write(base + 64, (0x7777).to_bytes(4, "little") + b"\xff" * 4 + b"A" * 1536)
        elif case == "abort_being_written":  # as if a rank died while writing its abort
            _write(base + 64, (0xFFFFFFFF).to_bytes(4, "little"))
        elif case == "fingerprint":  # garbage fingerprints, "arrived" at every future call
            post0 = base + lay["ctl"] + rank * lay["ctl_size"]
            _write(post0, (1 << 63).to_bytes(8, "little") + rng.randbytes(48))
        elif case == "p2p_header":  # a message to rank 0 with absurd size, tag and dtype
            slot = base + lay["pair_data"] + (1 * n + 0) * 2 * (64 + pair_slot)
            _write(
                slot,
                rng.randbytes(8)
                + (-5).to_bytes(8, "little", signed=True)
                + (1 << 62).to_bytes(8, "little")
                + (200).to_bytes(4, "little"),
            )
            _write(base + lay["pair_ctl"] + (1 * n + 0) * 64, (1).to_bytes(8, "little"))
        elif case == "everything_but_liveness":  # random bytes over all but the robust mutexes
            junk = rng.randbytes(size)
            for r in range(n):
                start = lay["ctl"] + r * lay["ctl_size"] + 256  # the mutex line
                junk = junk[:start] + bytes(ctypes.string_at(base + start, 64)) + junk[start + 64 :]
            _write(base, junk)
        time.sleep(2.5)  # alive, so that the peers' errors come from the garbage
        return None
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        if case == "p2p_header" and rank == 0:
            comm.recv(np.empty(16, np.float32), 1)
        for _ in range(3):
            comm.allreduce(np.ones(16, np.float32))
    except Exception as e:  # noqa: BLE001 - described to the parent
        return {
            "exc": type(e).__name__,
            "msg": str(e),
            "t": time.monotonic() - t0,
            "plait": isinstance(e, plait.PlaitError),
        }
    return {"exc": None, "t": time.monotonic() - t0}


@pytest.mark.parametrize(
    "case", ["abort_record", "abort_being_written", "fingerprint", "p2p_header", "everything_but_liveness"]
)
def test_garbage_in_the_segment_raises(case):
    """Rank 1 writes garbage into the live segment: its peers raise a PlaitError (no crash, no
    hang, no read past a buffer) well within their deadline."""
    results = run_ranks(_scribble, 3, timeout=60, args=(case,))
    for rank in (0, 2):
        res = results[rank]
        assert res["exc"] is not None and res["plait"], "rank %d: %s" % (rank, res)
        assert res["t"] < 2.0, "rank %d raised after %.1f s" % (rank, res["t"])
        assert len(res["msg"]) < 4000
