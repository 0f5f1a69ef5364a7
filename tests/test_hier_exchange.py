"""Exchanges on a multi-host communicator (csrc/hier/hier_p2p.cc): a rank that posts a receive and
then sends (irecv + send + wait, torch's batch_isend_irecv, a pipeline's neighbour exchange) must
not wait on its peer doing the same, whether the peer is on its host or another, as on one host.
Send/recv are stepped tasks that progress together; between hosts the engine's p2p_start/p2p_test
keep several transfers in flight (gloo here; the MPI engine's in test_hier_mpi.py)."""

import os
import signal
import time

import numpy as np
import pytest

import plait
from conftest import run_ranks

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import plait.torch  # noqa: E402,F401
from test_torch_backend import init_pg, run_torch  # noqa: E402

HOSTS_2x2 = ["a", "a", "b", "b"]
UNEVEN = ["a", "a", "b", "c"]

TIMEOUT = 30


def _value(src, dst, k):
    """What src sends dst: exact integers, distinct per pair and element."""
    return (1000 * src + 10 * dst + np.arange(k)) % 65521


def _pairs(rank, n, addr, hosts, cross, sizes):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    comm = plait.init(timeout=TIMEOUT, buffer_bytes=8192)  # small staging: the big size takes chunks
    assert isinstance(comm, plait.HierCommunicator), repr(comm)
    peer = (rank + 2) % n if cross else rank ^ 1
    assert (hosts[peer] != hosts[rank]) == cross
    got = []
    for k in sizes:
        out = np.zeros(k, np.int64)
        h = comm.recv(out, peer, tag=5, async_op=True)  # posted first, waited last
        comm.send(_value(rank, peer, k).astype(np.int64), peer, tag=5)
        h.wait()
        got.append(bool((out == _value(peer, rank, k)).all()))
    comm.finalize()
    return got


@pytest.mark.parametrize("cross", [False, True], ids=["same-host", "other-host"])
def test_irecv_then_send_on_both_ranks(cross):
    sizes = [0, 1, 31, 300_000]  # 300k int64: far past one staging chunk and gloo's inline header
    got = run_ranks(_pairs, 4, timeout=180, args=(HOSTS_2x2, cross, sizes))
    assert got == [[True] * len(sizes)] * 4, got


def _all_to_all_p2p(rank, n, addr, hosts):
    """Every rank posts a receive from every other and sends to every other, all async, then
    waits: local and remote transfers in flight together."""
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    comm = plait.init(timeout=TIMEOUT)
    k = 4097
    outs, hs = {}, []
    for src in range(n):
        if src != rank:
            outs[src] = np.zeros(k, np.int64)
            hs.append(comm.recv(outs[src], src, tag=7, async_op=True))
    for dst in range(n):
        if dst != rank:
            hs.append(comm.send(_value(rank, dst, k).astype(np.int64), dst, tag=7, async_op=True))
    for h in hs:
        h.wait()
    ok = all((outs[s] == _value(s, rank, k)).all() for s in outs)
    # then a ring: receive from the left, send to the right, wait
    left, right = (rank - 1) % n, (rank + 1) % n
    ring = np.zeros(5, np.int64)
    h = comm.recv(ring, left, tag=8, async_op=True)
    comm.send(np.full(5, rank, np.int64), right, tag=8)
    h.wait()
    comm.finalize()
    return ok, ring.tolist()


def test_everyone_to_everyone_in_flight_together():
    n = len(UNEVEN)
    got = run_ranks(_all_to_all_p2p, n, timeout=180, args=(UNEVEN,))
    for rank, (ok, ring) in enumerate(got):
        assert ok and ring == [(rank - 1) % n] * 5, (rank, ok, ring)


def _batch(rank, n, store_dir, hosts):
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    init_pg("plait", rank, n, store_dir, timeout=TIMEOUT)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    from_prev = torch.zeros(1000)
    from_next = torch.zeros(1000)
    ops = [  # a pipeline stage's exchange with both neighbours, receives listed first
        dist.P2POp(dist.irecv, from_prev, prv),
        dist.P2POp(dist.irecv, from_next, nxt),
        dist.P2POp(dist.isend, torch.full((1000,), 10.0 * rank + 1), nxt),
        dist.P2POp(dist.isend, torch.full((1000,), 10.0 * rank + 2), prv),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    # a receive from any rank posted before this rank's own send
    src = -1
    got = torch.zeros(3)
    if rank == 0:
        w = dist.irecv(got)
        dist.send(torch.full((3,), 5.0), n - 1)
        w.wait()
        src = w._source_rank() if hasattr(w, "_source_rank") else -1
    elif rank == n - 1:
        mine = torch.zeros(3)
        dist.recv(mine, 0)
        dist.send(mine + rank, 0)
    dist.barrier()
    return from_prev[0].item(), from_next[0].item(), got.tolist(), src


@pytest.mark.parametrize("hosts", [HOSTS_2x2, UNEVEN], ids=["2x2", "3-hosts-uneven"])
def test_torch_batch_isend_irecv_across_hosts(tmp_path, hosts):
    n = len(hosts)
    for rank, (p, q, got, src) in enumerate(run_torch(_batch, n, tmp_path, timeout=120, args=(hosts,))):
        assert p == 10.0 * ((rank - 1) % n) + 1 and q == 10.0 * ((rank + 1) % n) + 2, (rank, p, q)
        if rank == 0:
            assert got == [5.0 + n - 1] * 3 and src in (n - 1, -1), (got, src)


def _stranded(rank, n, addr, hosts, how):
    """Rank 0 posts a receive from rank 2 (another host) and sends to rank 1 (its host), both in
    flight; rank 2 never sends (timeout), sends another size (mismatch) or is killed: rank 0's
    receive raises that, and every rank learns of it, never a hang."""
    os.environ["PLAIT_HOST_ID"] = hosts[rank]
    comm = plait.init(timeout=5 if how == "timeout" else 30)
    comm.barrier()
    start = time.monotonic()
    try:
        if rank == 0:
            h = comm.recv(np.zeros(5000, np.int64), 2, tag=3, async_op=True)
            comm.send(np.ones(7, np.int64), 1, tag=3)
            h.wait()
        elif rank == 1:
            comm.recv(np.zeros(7, np.int64), 0, tag=3)
            comm.barrier()
        elif rank == 2:
            if how == "mismatch":
                comm.send(np.zeros(4000, np.int64), 0, tag=3)
            elif how == "killed":
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
            comm.barrier()
        else:
            comm.barrier()
    except plait.PlaitError as e:
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", time.monotonic() - start, ""


@pytest.mark.parametrize("how", ["timeout", "mismatch", "killed"])
def test_failed_receive_in_flight_raises_everywhere(how):
    res = run_ranks(_stranded, 4, timeout=120, args=(HOSTS_2x2, how), may_die=(2,) if how == "killed" else ())
    kind, took, msg = res[0]
    want = {"timeout": "TimeoutError", "mismatch": "MismatchError", "killed": "PeerLostError"}[how]
    assert kind == want and took < 20, res[0]
    assert "rank 2" in msg or "member 2" in msg, msg
    for r in (1, 3) if how == "killed" else (1, 2, 3):
        kind, took, msg = res[r]
        assert kind != "no error" and took < 25, (r, res[r])
