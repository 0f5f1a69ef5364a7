"""Where a grouped allreduce's tensors sit in the fusion buffer, kept across calls.

A training loop submits the same group every step (DistributedOptimizer's groups, a
grouped_allreduce_ of a fixed list of tensors). For many small tensors, per-tensor Python and
torch dispatch (a view, a check, a copy each) cost more than the reduction itself, so a group's
layout is built once and reused while the same tensor objects keep the same storage and shapes:
copy-in is one torch.cat into the fusion buffer, copy-out one pass of numpy slice assignments over
views made once (a foreach copy for dtypes numpy lacks), then one version bump for autograd.

A layout holds views of its tensors (their storage) but only weak references to the tensor
objects: when one of them is freed (a gradient set to None, a list dropped) its layout goes too,
so a loop that makes new tensors every step keeps nothing alive. At most _MAX layouts are kept,
and clear() (at hvd.shutdown) drops them all, with their views of the fusion buffer.

Where plait's native torch module is built (plait.torch compiles it: csrc/torch/horovod.cc), a CPU
group's layout check, copy-in (with the prescale factor), copy-out (with the postscale factor or
the average's 1/size) and version bump are one C++ call each over the whole list instead of a
dispatch per tensor. The module is loaded at the first group, never at import, so scripts that do
not group pay nothing for it; where it cannot be built (plait.torch raises NativeBuildError), or
with PLAIT_HOROVOD_NATIVE=0 (read at hvd.init), the numpy path below does the same work.
"""

import json
import os
import sys
import weakref

import numpy as np
import torch

from . import _device

_MAX = 32  # groups kept; the oldest is dropped first
_cache = {}  # tuple of the tensors' ids -> GroupLayout
_by_head = {}  # (id of the first tensor, length) -> the newest such GroupLayout: lookup's first try
_NATIVE = []  # [module or None] once decided; emptied by clear() (hvd.shutdown)


def native():
    """plait's native torch module when it is (or can be) built and not turned off, else None."""
    if not _NATIVE:
        mod = None
        if os.environ.get("PLAIT_HOROVOD_NATIVE", "1") != "0":
            try:
                from plait.torch import _native

                mod = _native.load()
            except ImportError:  # NativeBuildError (no compiler, headers, ninja): numpy's path
                mod = None
        _NATIVE.append(mod)
    return _NATIVE[0]


def loaded():
    """native() when that loads nothing new: decided already, or plait.torch's module built by
    someone else (the coordinator's cached fast path uses it, but never compiles it itself)."""
    if _NATIVE:
        return _NATIVE[0]
    mod = sys.modules.get("plait.torch._native")
    if mod is not None and getattr(mod, "_module", None) is not None:
        return native()
    return None


def shapes_text(shapes):
    """A group's tensor shapes as the one string its request carries (ranks compare it; encoding a
    string each cycle costs far less than a list of lists)."""
    return json.dumps([list(s) for s in shapes], separators=(",", ":"))


def _meta(tensors):
    return list(map(torch.Tensor.data_ptr, tensors)), list(map(torch.Tensor.size, tensors))


class Part:
    """One dtype's tensors of a group (one request): flat views to gather from, in order."""

    __slots__ = (
        "idx",
        "dtype",
        "device",
        "flat",
        "shapes",
        "sizes",
        "total",
        "nat",
        "grp",
        "_dst",
        "_src_at",
        "_src",
    )

    def __init__(self, idx, tensors, nat):
        self.idx = idx  # positions in the group
        self.dtype = tensors[0].dtype
        self.device = _device.layer.index(tensors[0])
        self.shapes = shapes_text(t.shape for t in tensors)
        self.nat = nat if self.device < 0 else None  # CUDA tensors: torch's copies
        self.flat = self.grp = self._dst = None
        if self.nat is not None:  # C++ detaches them: no views made here, one call for the group
            self.grp = self.nat._HvdGroup(tensors)
            self.sizes = None
            self.total = sum(map(torch.Tensor.numel, tensors))
        else:
            self.flat = [t.detach().view(-1) for t in tensors]
            self.sizes = [f.numel() for f in self.flat]
            self.total = sum(self.sizes)
            try:
                self._dst = [f.numpy() for f in self.flat]
            except (TypeError, RuntimeError):  # bfloat16 and friends: torch copies instead
                self._dst = None
        self._src_at, self._src = None, None

    def gather(self, piece, scale=1.0):
        """The tensors' elements, in order, into piece (1-D, total elements, contiguous). Only the
        native path scales (scale != 1.0 is passed only when self.nat is set)."""
        if self.nat is not None:
            self.grp.gather(piece, scale)
        elif not self.flat:
            return
        elif self._dst is not None and piece.is_cpu:  # numpy: a quarter cheaper than torch.cat
            np.concatenate(self._dst, out=piece.numpy())
        else:
            torch.cat(self.flat, out=piece)

    def scatter(self, buffer, offset, piece, scale=1.0):
        """piece (the reduced elements: buffer's view at element offset) back into the tensors,
        times scale (native path only, as in gather)."""
        if self.nat is not None:
            self.grp.scatter(piece, scale)  # bumps the versions too
            return
        if self._dst is None:
            with torch.no_grad():
                torch._foreach_copy_(self.flat, list(piece.split(self.sizes)))
            return
        if self._src_at is None or self._src_at[0] is not buffer or self._src_at[1] != offset:
            arr, at, src = piece.numpy(), 0, []
            for n in self.sizes:
                src.append(arr[at : at + n])
                at += n
            self._src_at, self._src = (buffer, offset), src
        for d, s in zip(self._dst, self._src):
            d[...] = s
        torch.autograd.graph.increment_version(self.flat)  # views share their base's counter


class GroupLayout:
    __slots__ = ("refs", "meta", "parts")

    def __init__(self, key, tensors, by_dtype, nat):
        self.meta = nat._hvd_meta(tensors) if nat is not None else _meta(tensors)
        self.parts = [Part(idx, [tensors[i] for i in idx], nat) for idx in by_dtype]

        me = id(self)  # an id: a reference to self from its own weakrefs' callback is a cycle

        def forget(_ref, key=key, me=me):
            _cache.pop(key, None)
            head = (key[0], len(key)) if key else None
            if id(_by_head.get(head)) == me:
                del _by_head[head]

        # While every tensor lives, the ids in the key are theirs alone.
        self.refs = [weakref.ref(t, forget) for t in tensors]


def lookup(tensors):
    """The layout of this group if it was seen before and its tensors are unchanged (the same
    storage, dtype, device, shape and contiguity: one native call, else two Python lists), else
    None. The newest layout of the same first tensor and length is tried first: the check above
    compares every tensor's storage address, shape and dtype, so a hit needs no key of all the
    ids (3-4 us for 100 tensors); a miss looks the whole key up."""
    if not tensors:
        return None
    nat = native()
    lay = _by_head.get((id(tensors[0]), len(tensors)))
    if lay is not None and _same(nat, tensors, lay):
        return lay
    lay = _cache.get(tuple(map(id, tensors)))
    if lay is None or not _same(nat, tensors, lay):
        return None
    _by_head[(id(tensors[0]), len(tensors))] = lay
    return lay


def _same(nat, tensors, lay):
    if nat is not None:
        return nat._hvd_same(tensors, lay.meta)
    return _meta(tensors) == lay.meta


def remember(tensors, by_dtype):
    """A new layout for a group of contiguous tensors (by_dtype: the positions of each dtype)."""
    key = tuple(map(id, tensors))
    lay = GroupLayout(key, tensors, by_dtype, native())
    if len(_cache) >= _MAX:
        _cache.pop(next(iter(_cache)), None)
    _cache[key] = lay
    if key:
        if len(_by_head) >= _MAX:
            _by_head.pop(next(iter(_by_head)), None)
        _by_head[(key[0], len(key))] = lay
    return lay


def clear():
    _cache.clear()
    _by_head.clear()
    _NATIVE.clear()  # the next hvd.init reads PLAIT_HOROVOD_NATIVE again
