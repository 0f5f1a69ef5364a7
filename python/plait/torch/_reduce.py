"""Reduction ops: torch's ReduceOp onto plait's op names, and the buffers a reduction crosses in.

plait reduces sum, prod, min, max and avg (floating point). The rest of ReduceOp is built here:
PREMUL_SUM multiplies a copy of the input by its factor, then sums; AVG on integers sums and
then divides (truncating, as NCCL does); BAND/BOR/BXOR, which plait has no kernel for, gather
every rank's input and reduce locally (the slow path, but exact).
"""

import functools

import torch
from torch.distributed import ReduceOp

from . import _tensors
from ._errors import PlaitUnsupportedError

_T = ReduceOp.RedOpType
SUM, AVG, PRODUCT, MIN, MAX = _T.SUM, _T.AVG, _T.PRODUCT, _T.MIN, _T.MAX
BAND, BOR, BXOR, PREMUL_SUM = _T.BAND, _T.BOR, _T.BXOR, _T.PREMUL_SUM

_PLAIT = {SUM: "sum", AVG: "avg", PRODUCT: "prod", MIN: "min", MAX: "max", PREMUL_SUM: "sum"}
_BITWISE = {BAND: torch.bitwise_and, BOR: torch.bitwise_or, BXOR: torch.bitwise_xor}
_ADDITIVE = (SUM, AVG, PREMUL_SUM)

# (kind's int value, dtype) -> (plait op, dtype name): reductions plait does on the tensor as is.
FAST = {}
for _dt in _tensors.NATIVE:
    for _k in (SUM, PRODUCT, MIN, MAX) + ((AVG,) if _dt.is_floating_point else ()):
        FAST[(_k.value, _dt)] = (_PLAIT[_k], "bfloat16" if _dt == torch.bfloat16 else None)


class Red:
    """A ReduceOp taken apart: .kind (RedOpType) and .factor (PREMUL_SUM only)."""

    __slots__ = ("kind", "factor")

    def __init__(self, op):
        if type(op) is not _T:  # a ReduceOp (isinstance says yes for a RedOpType too)
            self.kind = op.op
            self.factor = op.factor if self.kind == PREMUL_SUM else None
        else:  # a bare RedOpType, e.g. dist.ReduceOp.SUM
            self.kind = op
            self.factor = None
            if op == PREMUL_SUM:
                raise PlaitUnsupportedError("PREMUL_SUM needs a factor: use dist._make_nccl_premul_sum")

    @property
    def gathers(self):
        """Whether this op takes the allgather-then-reduce-locally path."""
        return self.kind in _BITWISE

    def __str__(self):
        return str(self.kind).rsplit(".", 1)[-1]


def plan(x, y, red, size, op, inplace_ok):
    """(src, dst, plait op name) so that plait reducing src into dst leaves the result in y.

    Steps to run after the call (divide, cast or copy back into y) are appended to op.after.
    inplace_ok(src, dst) says whether plait accepts src overlapping dst as this collective's
    in-place form; any other overlap gets src copied.
    """
    kind = red.kind
    if x.is_complex() or y.is_complex():
        if kind not in _ADDITIVE:
            raise PlaitUnsupportedError(f"{red} on complex tensors (c10d allows SUM, AVG, PREMUL_SUM)")
        x = torch.view_as_real(x.resolve_conj())
        y = torch.view_as_real(y)
    wire, how = _tensors.wire_dtype(x.dtype, kind in (SUM, PRODUCT))
    if wire is None:
        raise PlaitUnsupportedError(f"{red} on {x.dtype} tensors")
    src, fresh = x, False
    if kind == PREMUL_SUM:
        f = red.factor
        if isinstance(f, torch.Tensor):
            f = f.to("cpu")
        src, fresh = torch.mul(src, f).to(x.dtype), True
    if how == "widen":
        src, fresh = src.to(wire, memory_format=torch.contiguous_format), True
    else:
        if not src.is_contiguous():
            src, fresh = src.contiguous(), True
        if how == "reinterpret":
            src = src.view(wire)
    post = []
    if how == "widen" or not y.is_contiguous():
        if fresh and how != "reinterpret" and src.shape == y.shape:
            dst = target = src  # reduce in place in the copy we made anyway
        else:
            target = torch.empty(y.shape, dtype=wire if how == "widen" else y.dtype)
            dst = target.view(wire) if how == "reinterpret" else target
        post.append(lambda: y.copy_(target))
    else:
        dst = y.view(wire) if how == "reinterpret" else y
    name = _PLAIT[kind]
    if kind == AVG and not wire.is_floating_point:
        if wire == torch.bool:
            raise PlaitUnsupportedError("AVG on bool tensors")
        name = "sum"
        post.insert(0, lambda: dst.div_(size, rounding_mode="trunc"))
    if (
        not fresh
        and dst is not src
        and _tensors.overlaps(src, dst)
        and not (_tensors.same_bytes(src, dst) or inplace_ok(src, dst))
    ):
        src = src.clone()
    op.after.extend(post)
    return src, dst, name


def gathered(stack, red):
    """The reduction over dim 0 of every rank's input (the BAND/BOR/BXOR path)."""
    fn = _BITWISE[red.kind]
    if stack.is_floating_point() or stack.is_complex():
        raise PlaitUnsupportedError(f"{red} on {stack.dtype} tensors")
    return functools.reduce(fn, stack.unbind(0))
