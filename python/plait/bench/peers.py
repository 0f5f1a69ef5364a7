"""The implementations a sweep times: plait (one per algorithm) and its peers, torch.distributed's
gloo, MPI through mpi4py, and DeepSpeed's shared-memory allreduce. Each turns (collective, x, out)
into a zero-argument call over the harness's numpy buffers, so every implementation runs under the
same timing loop and the same result check. A peer that cannot start raises Skip with the reason,
which the report prints.
"""

import os

import numpy as np

OUT, IN = "out-of-place", "in-place"


class Skip(Exception):
    """A peer that is not available here; the message says why."""


SHARED = "plait+shared"


class Plait:
    """plait itself; `shared`: over buffers from plait.empty (the harness allocates them), which
    peers on the host map instead of reaching through kernel copies."""

    def __init__(self, comm, algorithm="auto", name=None, shared=False):
        self.comm, self.algorithm, self.shared = comm, algorithm, shared
        self.name = name or (SHARED if shared else "plait" if algorithm == "auto" else f"plait:{algorithm}")
        self.version = getattr(comm, "engine", "")

    def supports(self, coll, dtype, op, inplace):
        return None

    def prepare(self, coll, x, out, dtype, op, root):
        c, name = self.comm, coll.name
        kw = {"dtype": "bfloat16"} if dtype == "bfloat16" else {}
        if self.algorithm != "auto":  # every collective takes the one the row is named after
            kw["algorithm"] = self.algorithm
        if name == "allreduce":
            return lambda: c.allreduce(x, out, op=op, **kw)
        if name == "reduce_scatter":
            return lambda: c.reduce_scatter(x, out, op=op, **kw)
        if name == "allgather":
            return lambda: c.allgather(x, out, **kw)
        if name == "broadcast":
            o = None if out is x else out
            return lambda: c.broadcast(x, root, out=o, **kw)
        if name == "reduce":
            return lambda: c.reduce(x, root, out=out, op=op, **kw)
        return lambda: c.alltoall(x, out, **kw)


def plait_impls(comm, collective, choice, algorithms):
    """Plait variants for `-a choice` ('auto', 'all' or a comma list); (impls, notes)."""
    names = list(algorithms)
    if choice == "auto" or len(names) <= 1:  # one algorithm: "auto" is that one
        return [Plait(comm)], []
    if choice == "all":
        return [Plait(comm)] + [Plait(comm, a) for a in names], []
    wanted = [a for a in choice.split(",") if a]
    notes = [
        f"plait:{a}: not an algorithm of {collective} ({', '.join(names)})"
        for a in wanted
        if a not in names and a != "auto"
    ]
    return [Plait(comm, a) for a in wanted if a in names or a == "auto"], notes


class Gloo:
    """torch.distributed over gloo; only the placements torch's API has natively."""

    name = "gloo"
    _NATIVE = {
        "allreduce": IN,
        "broadcast": IN,
        "reduce": IN,
        "reduce_scatter": OUT,
        "allgather": OUT,
        "alltoall": OUT,
    }

    def __init__(self, torch, dist):
        self.torch, self.dist = torch, dist
        R = dist.ReduceOp
        self.ops = {"sum": R.SUM, "prod": R.PRODUCT, "min": R.MIN, "max": R.MAX}
        if hasattr(R, "AVG"):
            self.ops["avg"] = R.AVG
        self.version = torch.__version__

    def supports(self, coll, dtype, op, inplace):
        native = self._NATIVE[coll.name]
        if (IN if inplace else OUT) != native:
            return f"torch.distributed's {coll.name} is {native} only"
        if coll.reduces and op not in self.ops:
            return f"gloo has no op {op}"
        return None

    def _t(self, a):
        if a is None:
            return None
        if a.dtype == np.uint16:  # raw bfloat16 bits
            return self.torch.from_numpy(a.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(a)

    def prepare(self, coll, x, out, dtype, op, root):
        d, tx, to, name = self.dist, self._t(x), self._t(out), coll.name
        rop = self.ops.get(op)
        if name == "allreduce":
            return lambda: d.all_reduce(tx, op=rop)
        if name == "broadcast":
            return lambda: d.broadcast(tx, src=root)
        if name == "reduce":
            return lambda: d.reduce(tx, dst=root, op=rop)
        if name == "reduce_scatter":  # *_single are the names newer torch prefers
            f = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
            return lambda: f(to, tx, op=rop)
        if name == "allgather":
            f = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
            return lambda: f(to, tx)
        return lambda: d.all_to_all_single(to, tx)

    def close(self):
        self.dist.destroy_process_group()


def start_gloo(rank, size, init_method):
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure just means "no gloo here"
        raise Skip(f"torch does not import ({type(e).__name__}: {e}); pip install torch") from None
    if not dist.is_available() or not dist.is_gloo_available():
        raise Skip("this torch build has no gloo backend")
    if init_method is None:
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            raise Skip("MASTER_ADDR/MASTER_PORT are not set for torch.distributed")
        init_method = "env://"
    torch.set_num_threads(1)  # its intra-op pool would fight the ranks for the cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    return Gloo(torch, dist)


class Mpi:
    """MPI through mpi4py; the ranks must have been started by mpirun."""

    name = "mpi"
    _DTYPES = ("float32", "float64", "int8", "uint8", "int32", "int64")

    def __init__(self, MPI):
        self.MPI, self.comm = MPI, MPI.COMM_WORLD
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self.version = MPI.Get_library_version().replace("\0", "").splitlines()[0].strip()

    def supports(self, coll, dtype, op, inplace):
        if dtype not in self._DTYPES:
            return f"MPI has no standard {dtype}"
        if coll.reduces and op not in self.ops:
            return f"MPI has no op {op}"
        if inplace and coll.name == "reduce_scatter":
            return "MPI's in-place reduce_scatter puts the result elsewhere than NCCL's"
        if not inplace and coll.name == "broadcast":
            return "MPI's broadcast is in-place only"
        return None

    def prepare(self, coll, x, out, dtype, op, root):
        c, name, rop = self.comm, coll.name, self.ops.get(op)
        send = self.MPI.IN_PLACE if out is not None and x is out else x
        if name == "allreduce":
            return lambda: c.Allreduce(send, out, op=rop)
        if name == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(x, out, op=rop)
        if name == "allgather":
            if out.ctypes.data <= x.ctypes.data < out.ctypes.data + out.nbytes:  # x is my block
                return lambda: c.Allgather(self.MPI.IN_PLACE, out)
            return lambda: c.Allgather(x, out)
        if name == "broadcast":
            return lambda: c.Bcast(x, root=root)
        if name == "reduce":
            return lambda: c.Reduce(send, out, op=rop, root=root)
        return lambda: c.Alltoall(send, out)

    def close(self):
        pass


class DeepSpeed:
    """DeepSpeed's CPU shared-memory allreduce (deepspeed.comm.inference_all_reduce, the kernel its
    inference engine uses between the ranks of one host): float32/bf16/fp16 sum, in place only."""

    name = "deepspeed"
    _DTYPES = ("float32", "bfloat16", "float16")

    def __init__(self, torch, dcomm, version, shm_tag, own_group):
        self.torch, self.dcomm, self.version, self._shm_tag = torch, dcomm, version, shm_tag
        self._own_group = own_group

    def supports(self, coll, dtype, op, inplace):
        if coll.name != "allreduce":
            return "DeepSpeed's shared-memory kernel is allreduce only"
        if dtype not in self._DTYPES or op != "sum":
            return "DeepSpeed's shared-memory allreduce is sum over float32/bf16/fp16 only"
        if not inplace:
            return "DeepSpeed's inference_all_reduce is in-place only"
        return None

    def prepare(self, coll, x, out, dtype, op, root):
        t = (
            self.torch.from_numpy(x.view(np.int16)).view(self.torch.bfloat16)
            if dtype == "bfloat16"
            else self.torch.from_numpy(x)
        )
        f, sop = self.dcomm.inference_all_reduce, self.dcomm.ReduceOp.SUM
        return lambda: f(t, sop)

    def close(self):
        # DeepSpeed never unlinks its segments (deepspeed_allreduce_buffer_<...>_<addr>_<port>_<rank>).
        import glob

        for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*_%s_*" % self._shm_tag):
            try:
                os.unlink(path)
            except OSError:
                pass
        if self._own_group and self.torch.distributed.is_initialized():
            self.torch.distributed.destroy_process_group()


def start_deepspeed(rank, size, init_method):
    """DeepSpeed over the torch.distributed group start_gloo made (or makes)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import torch
        import deepspeed
        import deepspeed.comm as dcomm
    except Exception as e:  # noqa: BLE001
        raise Skip(f"deepspeed does not import ({type(e).__name__}: {e}); pip install deepspeed") from None
    if init_method and init_method.startswith("tcp://"):
        host, port = init_method[len("tcp://") :].rsplit(":", 1)
        os.environ.setdefault("MASTER_ADDR", host)
        os.environ.setdefault("MASTER_PORT", port)
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise Skip("MASTER_ADDR/MASTER_PORT are not set for DeepSpeed")
    os.environ["LOCAL_SIZE"] = str(size)  # its shared-memory path is taken only when all are local
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init_method or "env://", rank=rank, world_size=size)
    deepspeed.init_distributed(dist_backend="gloo")  # builds (once, ~30 s) and loads the shm op
    if not hasattr(torch.ops, "deepspeed") or not hasattr(torch.ops.deepspeed, "inference_all_reduce_"):
        raise Skip("DeepSpeed's shared-memory op did not build here (it needs a C++ compiler)")
    tag = "%s_%s" % (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    return DeepSpeed(torch, dcomm, deepspeed.__version__, tag, own_group)
