"""plait.horovod's ops on CUDA tensors, on a machine without a GPU.

A CPU-only torch cannot make CUDA tensors, so these tests run the coordinator's GPU logic one seam
below: common/_device.py's `layer` (every CUDA call plait.horovod makes: device of a tensor, ready
and done events, its stream, the GPU fusion buffer, the host wait) is replaced by a recording fake
whose "GPU tensors" are CPU tensors of a marker subclass. Everything above it is the real code: the
requests carry the device, ranks compare CPU/GPU, the executor takes its GPU branch (the device's
fusion buffer, no shared-memory route, the stream scope), and the collectives run on plait with
exact results. What the fake records shows the ordering Horovod keeps: the op waits on its
producer stream's ready event inside the coordinator's stream, and synchronize() blocks the host
on the done event recorded after the last copy out. The last test hands the GPU path's calls to
plait's recording GPU queue (_C._FakeGpuQueue, as tests/test_cuda_cpu.py does) on CUDA builds.
"""

import contextlib
import itertools
import math
import threading

import pytest

torch = pytest.importorskip("torch")


class Gpu(torch.Tensor):
    """A CPU tensor that the fake layer reports as living on GPU 0 (ops on it keep the mark)."""


def gpu(t):
    return t.as_subclass(Gpu)


class FakeLayer:
    """common/_device.CudaLayer's interface, recording what the coordinator asks of CUDA."""

    def __init__(self):
        self.log = []
        self._ids = itertools.count(1)
        self._buffers = {}
        self._tls = threading.local()  # the current stream is per thread, as torch's is

    @property
    def in_stream(self):
        return getattr(self._tls, "stream", None)

    @in_stream.setter
    def in_stream(self, index):
        self._tls.stream = index

    def index(self, t):
        return 0 if isinstance(t, Gpu) else -1

    def device(self, index):
        return torch.device("cpu")

    def current(self):
        return 0

    def _event(self, what, index):
        ev = (what, next(self._ids), index)
        self.log.append(("record",) + ev + (self.in_stream,))
        return ev

    def ready(self, index):
        return self._event("ready", index)

    def done(self, index):
        return self._event("done", index)

    @contextlib.contextmanager
    def stream(self, index):
        assert self.in_stream is None, "stream scopes do not nest"
        self.in_stream = index
        self.log.append(("enter", index))
        try:
            yield
        finally:
            self.in_stream = None
            self.log.append(("exit", index))

    def wait(self, ev):
        assert self.in_stream is not None, "ready events are waited on the coordinator's stream"
        self.log.append(("wait", ev[1], self.in_stream))

    def buffer(self, index, nbytes):
        assert self.in_stream == index, "the GPU fusion buffer is used on its device's stream"
        buf = self._buffers.get(index)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[index] = gpu(torch.zeros(max(nbytes, 64), dtype=torch.uint8))
        self.log.append(("buffer", index, nbytes))
        return buf[:nbytes]

    def synchronize(self, ev):
        assert ev[0] == "done"
        self.log.append(("sync", ev[1]))

    def clear(self):
        self._buffers.clear()

    def check_order(self):
        """Ready events are waited (once; an op that failed its check never runs, so never waits)
        inside a stream scope, and every done event was recorded inside a scope and then waited
        on by the host once. Returns (ready events, waited, done events)."""
        recorded = {e[2]: e for e in self.log if e[0] == "record"}
        waited = [e[1] for e in self.log if e[0] == "wait"]
        synced = [e[1] for e in self.log if e[0] == "sync"]
        readies = [i for i, e in recorded.items() if e[1] == "ready"]
        dones = [i for i, e in recorded.items() if e[1] == "done"]
        assert len(set(waited)) == len(waited) and set(waited) <= set(readies), (waited, readies)
        assert sorted(synced) == sorted(dones), (synced, dones)
        assert all(recorded[i][4] is None for i in readies), "ready: on the submitting thread's stream"
        assert all(recorded[i][4] == 0 for i in dones), "done: on the coordinator's stream"
        pos = {(e[0], e[1]): k for k, e in enumerate(self.log) if e[0] in ("wait", "sync")}
        for i in dones:
            at = next(k for k, e in enumerate(self.log) if e[0] == "record" and e[2] == i)
            assert at < pos[("sync", i)]
        return len(readies), len(waited), len(dones)


class Unmarked:
    """A plait communicator that gets the fake GPU tensors as the plain tensors they are (in
    place: same storage). Stands where plait's GPU path would take the CUDA tensors."""

    def __init__(self, comm):
        self.comm = comm

    def __getattr__(self, name):
        real = getattr(self.comm, name)
        if not callable(real):
            return real

        def call(*args, **kw):
            plain = [a.as_subclass(torch.Tensor) if isinstance(a, Gpu) else a for a in args]
            return real(
                *plain, **{k: v.as_subclass(torch.Tensor) if isinstance(v, Gpu) else v for k, v in kw.items()}
            )

        return call


def _hvd_on_fake_gpu():
    from plait.horovod.common import _device, basics

    fake = _device.layer = FakeLayer()
    import plait.horovod.torch as hvd

    hvd.init()
    entry = basics._st().registry[0]
    entry.comm = Unmarked(entry.comm)
    return hvd, fake


def _collectives(rank, n, _addr):
    hvd, fake = _hvd_on_fake_gpu()
    from plait.horovod.common import basics

    ex = basics.controller().executor
    tri = n * (n - 1) // 2
    # in place, one tensor: reduced where it lies (no fusion buffer)
    x = gpu(torch.arange(6, dtype=torch.float32) + rank)
    assert hvd.allreduce_(x, op=hvd.Sum) is x
    assert x.tolist() == [n * i + tri for i in range(6)]
    assert not [e for e in fake.log if e[0] == "buffer"]
    # out of place, Average, with scale factors
    y = gpu(torch.full((4,), 2.0 * (rank + 1)))
    out = hvd.allreduce(y, op=hvd.Average, prescale_factor=3.0, postscale_factor=0.5)
    assert out.tolist() == [3.0 * (n + 1) / 2] * 4 and y.tolist() == [2.0 * (rank + 1)] * 4
    # integer Average truncates on the GPU path too
    i = gpu(torch.tensor([1, -1, 7], dtype=torch.int32) * (rank + 1))
    s = n * (n + 1) // 2
    assert hvd.allreduce(i, op=hvd.Average).tolist() == [math.trunc(v * s / n) for v in (1, -1, 7)]
    # a group of GPU and CPU tensors: one request (one plait call) per device, the GPU one fused in
    # the device's fusion buffer
    calls = ex.calls
    g = [gpu(torch.full((3,), float(k + rank))) for k in range(5)] + [
        torch.full((2,), float(k)) for k in range(3)
    ]
    hvd.grouped_allreduce_(g, op=hvd.Sum, name="mixed")
    assert [t.tolist() for t in g[:5]] == [[n * k + tri] * 3 for k in range(5)]
    assert [t.tolist() for t in g[5:]] == [[n * k] * 2 for k in range(3)]
    assert ex.calls - calls == 2
    assert ("buffer", 0, 5 * 3 * 4) in fake.log
    # many unnamed GPU allreduces in flight at once (fused when they meet in one cycle)
    hs = [hvd.allreduce_async_(gpu(torch.full((2,), float(k * rank))), op=hvd.Sum) for k in range(6)]
    assert [hvd.synchronize(h).tolist() for h in hs] == [[k * tri] * 2 for k in range(6)]
    # broadcast, allgather (uneven), alltoall, reducescatter
    b = gpu(torch.full((3,), float(rank)))
    hvd.broadcast_(b, root_rank=n - 1)
    assert b.tolist() == [float(n - 1)] * 3
    ag = hvd.allgather(gpu(torch.full((rank + 1, 2), rank, dtype=torch.int64)))
    assert ag.tolist() == [[r, r] for r in range(n) for _ in range(r + 1)]
    a2a = hvd.alltoall(gpu(torch.arange(n, dtype=torch.int32) + 10 * rank))
    assert a2a.tolist() == [rank + 10 * r for r in range(n)]
    rs = hvd.reducescatter(gpu(torch.ones(2 * n, 2)), op=hvd.Sum)
    assert rs.tolist() == [[float(n)] * 2] * 2
    ready, waited, done = fake.check_order()
    assert ready == waited, "every op ran"
    hvd.shutdown()
    return ready, done


def test_gpu_collectives_exact_and_stream_ordered(ranks):
    for n in (1, 2, 3):
        got = ranks(_collectives, n, timeout=120)
        assert len(set(got)) == 1 and got[0][0] >= 13, got


def _mismatch_then_good(rank, n, _addr):
    hvd, fake = _hvd_on_fake_gpu()
    t = torch.ones(4)
    with pytest.raises(hvd.HorovodInternalError, match=r"CPU/GPU device selection .*'allreduce.x'"):
        hvd.allreduce(gpu(t) if rank == 0 else t, name="x")
    out = hvd.allreduce(gpu(t), name="x", op=hvd.Sum)
    assert out.tolist() == [float(n)] * 4
    hvd.shutdown()
    ready, waited, done = fake.check_order()
    # rank 0's failed GPU op recorded a ready event and never ran; the good one ran everywhere
    assert (ready, waited, done) == ((2, 1, 1) if rank == 0 else (1, 1, 1))
    return True


def test_cpu_gpu_mismatch_fails_everywhere_then_works(ranks):
    assert ranks(_mismatch_then_good, 2, timeout=60) == [True, True]


def _join(rank, n, _addr):
    hvd, fake = _hvd_on_fake_gpu()
    last = n - 1
    if rank == last:  # joins first: zeros of the GPU ops' shapes on device 0 from now on
        who = hvd.join(device=0)
        assert ("enter", 0) in fake.log, "it took part on the GPU path"
    else:
        out = hvd.allreduce(gpu(torch.full((3,), float(rank + 1))), op=hvd.Sum, name="j")
        g = hvd.allgather(gpu(torch.tensor([rank])), name="jg")
        assert out.tolist() == [float(sum(range(1, n)))] * 3
        assert g.tolist() == list(range(n - 1))
        who = hvd.join()
    hvd.shutdown()
    return who


def test_join_with_gpu_ops(ranks):
    got = ranks(_join, 3, timeout=60)
    assert len(set(got)) == 1 and got[0] in (0, 1), got  # the last to join, the same everywhere


def _to_gpu_queue(rank, n, store):
    """The GPU path's calls as plait's recording GPU queue receives them."""
    from plait import _C
    from plait import _cuda as cu
    from test_cuda_cpu import FakeCuda

    hvd, fake = _hvd_on_fake_gpu()
    from plait.horovod.common import basics

    world = basics._st().comm
    cu.compiled = lambda: True
    cu.device_count = lambda: 1
    _C.cuda_pointer_device = lambda ptr: 0
    q = _C._FakeGpuQueue(world._c, 0, "nccl", 30.0, "")
    _C.gpu_attach(world._c, q)
    world._gpu = q

    class Handing:
        """world's collectives, given the executor's tensors (all on the GPU path here) as the CUDA arrays
        they stand for; the cycle's numpy frames pass as they are."""

        def __getattr__(self, name):
            real = getattr(world, name)

            def call(*args, **kw):
                at = iter(range(1, 64))

                def cai(a):
                    if not isinstance(a, torch.Tensor):  # the cycle's frames: numpy
                        return a
                    return FakeCuda(tuple(a.shape), "<f4", ptr=next(at) << 20)

                return real(*map(cai, args), **{k: cai(v) for k, v in kw.items()})

            return call

    basics._st().registry[0].comm = Handing()
    g = [gpu(torch.ones(5)) for _ in range(7)]
    hvd.grouped_allreduce_(g, op=hvd.Sum, name="q")
    hvd.allreduce_(gpu(torch.ones(11)), op=hvd.Max, name="one")
    hvd.broadcast_(gpu(torch.ones(3)), root_rank=1, name="b")
    hvd.allgather(gpu(torch.ones(2, 3)), name="ag")  # equal rows: one allgather, no padding
    hvd.reducescatter(gpu(torch.ones(4 * n)), op=hvd.Sum, name="rs")
    basics._st().registry[0].comm = world
    hvd.shutdown()
    return [r[:4] for r in q.records()]


@pytest.mark.skipif(
    not __import__("plait")._cuda.compiled(), reason="the GPU queue is compiled into CUDA builds only"
)
def test_gpu_ops_reach_plaits_gpu_queue(ranks):
    got = ranks(_to_gpu_queue, 2, timeout=60)
    assert got[0] == got[1], got
    # (collective, transport, count per rank, stream): the group of 7 x 5 is one allreduce of 35
    assert got[0] == [
        ("allreduce", "nccl", 35, 0),
        ("allreduce", "nccl", 11, 0),
        ("broadcast", "nccl", 3, 0),
        ("allgather", "nccl", 6, 0),
        ("reduce_scatter", "nccl", 4, 0),
    ]


def _other_devices(rank, n, _addr):
    import plait.horovod.torch as hvd

    hvd.init()
    m = torch.ones(3, device="meta")
    for call in (
        lambda: hvd.allreduce(m),
        lambda: hvd.grouped_allreduce([torch.ones(2), m]),
        lambda: hvd.broadcast_(m, 0),
    ):
        with pytest.raises(TypeError, match=rf"rank {rank}: .*CPU and CUDA tensors, got one on meta"):
            call()
    out = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # nothing was submitted: the next op runs
    hvd.shutdown()
    return out.tolist()


def test_tensors_on_other_devices_are_refused_on_the_calling_rank(ranks):
    assert ranks(_other_devices, 2, timeout=60) == [[2.0, 2.0]] * 2
