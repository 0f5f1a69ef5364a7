"""The collectives plait has no single call for, built from its send/recv: uneven all-to-all,
gather and scatter; and torch's send/recv themselves. CUDA tensors: even all-to-all and
send/recv go to plait's GPU path (NCCL), on torch's current stream; gather/scatter stay CPU-only.

plait progresses consecutive asynchronous sends and receives together, so issuing all of an
exchange's sends and receives before waiting on any cannot deadlock, whatever their order.
These ops are always asynchronous (an inline send could wait for a receive not yet issued).
"""

import torch

from . import _errors, _tensors
from ._errors import PlaitUnsupportedError

# Tag of the send/recv calls that build all-to-all, gather and scatter; out of the way of user
# tags (plait matches messages per pair in order and checks tags, so a clash shows as a mismatch).
_TAG = 0x706C6169_74000000


def one(tensors, what):
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    if len(tensors) != 1:
        raise _errors.PlaitInvalidArgument(f"plait {what}: one tensor per process (got {len(tensors)})")
    return tensors[0]


def root_of(opts):
    return opts.rootRank if opts is not None else 0


class Exchanges:
    """Mixin of ProcessGroupPlait (which provides _begin, _kw, _launch, _add, _fail, _comm)."""

    @_errors.mapped
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        op = self._begin("all_to_all_single", [output])
        n = self._size
        out_rows = _splits(output, output_split_sizes, n)
        in_rows = _splits(input, input_split_sizes, n)
        if out_rows is None or in_rows is None:
            self._fail(
                f"all_to_all_single: {_nrows(output)} output rows split {list(output_split_sizes)}, "
                f"{_nrows(input)} input rows split {list(input_split_sizes)}: not {n} splits "
                "covering the rows (or, without splits, rows that divide evenly)"
            )
        even = len(set(out_rows)) == 1 and out_rows == in_rows
        kw = self._kw(opts, even and self._sync(opts))  # send/recv never run inline
        if input.is_cuda or output.is_cuda:
            return self._cuda_alltoall(op, output, input, even, kw)
        dst = _tensors.sink(output, op)
        src = _tensors.source(input)
        if src is input and _tensors.overlaps(src, dst) and not (even and _tensors.same_bytes(src, dst)):
            src = src.clone()
        if even:
            self._add(op, self._comm.alltoall(_tensors.bytes_of(src), _tensors.bytes_of(dst), **kw))
        else:
            self._exchange(op, _rows(src, in_rows), _rows(dst, out_rows), kw)
        return self._launch(op, kw)

    alltoall_base = all_to_all_single

    @_errors.mapped
    def alltoall(self, outputs, inputs, opts=None):
        op = self._begin("alltoall", list(outputs))
        n = self._size
        if len(outputs) != n or len(inputs) != n:
            self._fail(f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs for a group of {n}")
        even = len({t.numel() * t.element_size() for t in list(outputs) + list(inputs)}) == 1
        kw = self._kw(opts, even and self._sync(opts))
        cuda = {t.is_cuda for t in list(outputs) + list(inputs)}
        if True in cuda:
            if cuda != {True}:
                self._fail("all_to_all: CUDA and CPU tensors mixed; pass all on one device")
            if not even:
                raise PlaitUnsupportedError(
                    f"{op.where}: uneven CUDA tensors (plait's GPU alltoall moves equal blocks)"
                )
        if even:
            src = torch.cat([_tensors.raw(_tensors.source(t)) for t in inputs])
            flat = torch.empty_like(src)
            if src.is_cuda:  # the copies into outputs follow on the same (current) stream
                self._add(op, self._comm.alltoall(src, flat, **kw))
            else:
                self._add(op, self._comm.alltoall(_tensors.bytes_of(src), _tensors.bytes_of(flat), **kw))
            nb = flat.numel() // n
            op.after.append(
                lambda: [_tensors.write_bytes(o, flat[j * nb : (j + 1) * nb]) for j, o in enumerate(outputs)]
            )
        else:
            dsts = [_tensors.sink(t, op) for t in outputs]
            srcs = [_tensors.source(t) for t in inputs]
            srcs = [s.clone() if any(_tensors.overlaps(s, d) for d in dsts) else s for s in srcs]
            self._exchange(op, srcs, dsts, kw)
        return self._launch(op, kw)

    def _cuda_alltoall(self, op, output, input, even, kw):
        """Even all-to-all of CUDA tensors: one plait alltoall on the GPU path (NCCL)."""
        if not (input.is_cuda and output.is_cuda):
            self._fail(
                f"all_to_all: input on {input.device}, output on {output.device}; pass both on one device"
            )
        if not even:
            raise PlaitUnsupportedError(
                f"{op.where}: uneven splits of CUDA tensors (plait's GPU alltoall moves equal blocks)"
            )
        src, dst = self._cuda_bytes(input, op.where), self._cuda_bytes(output, op.where)
        if _tensors.overlaps(src, dst):
            src = src.clone()  # the GPU alltoall cannot run in place
        self._add(op, self._comm.alltoall(src, dst, **kw))
        return self._launch(op, kw)

    def _exchange(self, op, srcs, dsts, kw):
        """srcs[j] goes to rank j and dsts[j] comes from rank j, over plait send/recv (which
        progresses the consecutive sends and receives together, so the order cannot deadlock)."""
        me = self._rank
        mine_src, mine_dst = srcs[me], dsts[me]
        if mine_src.numel() * mine_src.element_size() != mine_dst.numel() * mine_dst.element_size():
            self._fail(
                f"all_to_all: rank {me} sends itself {mine_src.numel()} elements "
                f"but expects {mine_dst.numel()}"
            )
        comm = self._comm
        for j in range(self._size):
            if j != me:
                self._add(op, comm.send(_tensors.bytes_of(srcs[j]), j, tag=_TAG, **kw))
                self._add(op, comm.recv(_tensors.bytes_of(dsts[j]), j, tag=_TAG, **kw))
        op.after.insert(0, lambda: _tensors.raw(mine_dst).copy_(_tensors.raw(mine_src)))

    @_errors.mapped
    def gather(self, output_lists, inputs, opts=None):
        x = one(inputs, "gather")
        root, me = root_of(opts), self._rank
        outs = output_lists[0] if me == root else []
        op = self._begin("gather", outs)
        kw = self._kw(opts, False)
        src = _tensors.source(x)
        if me != root:
            self._add(op, self._comm.send(_tensors.bytes_of(src), root, tag=_TAG, **kw))
            return self._launch(op, kw)
        if len(outs) != self._size:
            self._fail(f"gather: {len(outs)} outputs for a group of {self._size}")
        if src is x and any(o.is_contiguous() and _tensors.overlaps(src, o) for o in outs):
            src = src.clone()
        for r, o in enumerate(outs):
            if r != me:
                self._add(op, self._comm.recv(_tensors.bytes_of(_tensors.sink(o, op)), r, tag=_TAG, **kw))
        op.after.insert(0, lambda: outs[me].copy_(src.view(outs[me].shape)))
        return self._launch(op, kw)

    @_errors.mapped
    def scatter(self, outputs, input_lists, opts=None):
        out = one(outputs, "scatter")
        root, me = root_of(opts), self._rank
        op = self._begin("scatter", [out])
        kw = self._kw(opts, False)
        if me != root:
            self._add(op, self._comm.recv(_tensors.bytes_of(_tensors.sink(out, op)), root, tag=_TAG, **kw))
            return self._launch(op, kw)
        ins = input_lists[0]
        if len(ins) != self._size:
            self._fail(f"scatter: {len(ins)} inputs for a group of {self._size}")
        for r, t in enumerate(ins):
            if r != me:
                self._add(op, self._comm.send(_tensors.bytes_of(_tensors.source(t)), r, tag=_TAG, **kw))
        mine = ins[me].clone()
        op.after.insert(0, lambda: out.copy_(mine.view(out.shape)))
        return self._launch(op, kw)

    @_errors.mapped
    def send(self, tensors, dstRank, tag=0):
        t = one(tensors, "send")
        op = self._begin(f"send to rank {dstRank}", [t])
        kw = self._kw(None, False)
        if t.is_cuda:
            self._add(
                op, self._comm.send(self._cuda_bytes(t, op.where), dstRank, tag=_cuda_tag(tag, op), **kw)
            )
            return self._launch(op, kw)
        _tensors.check_cpu(t, op.where)
        self._add(op, self._comm.send(_tensors.bytes_of(_tensors.source(t)), dstRank, tag=tag, **kw))
        return self._launch(op, kw)

    @_errors.mapped
    def recv(self, tensors, srcRank, tag=0):
        t = one(tensors, "recv")
        op = self._begin(f"recv from rank {srcRank}", [t])
        kw = self._kw(None, False)
        if t.is_cuda:
            self._add(
                op, self._comm.recv(self._cuda_bytes(t, op.where), srcRank, tag=_cuda_tag(tag, op), **kw)
            )
            return self._launch(op, kw)
        _tensors.check_cpu(t, op.where)
        self._add(op, self._comm.recv(_tensors.bytes_of(_tensors.sink(t, op)), srcRank, tag=tag, **kw))
        return self._launch(op, kw)

    def recv_anysource(self, tensors, tag=0):
        raise PlaitUnsupportedError(
            "plait: recv from any source is not supported (plait matches messages per sender, in "
            "order); pass src= to dist.recv / dist.irecv"
        )


def _cuda_tag(tag, op):
    if tag:
        raise PlaitUnsupportedError(
            f"{op.where}: tag {tag} on CUDA tensors (GPU send/recv run over NCCL, "
            f"which has no tags; they match in issue order per pair of ranks)"
        )
    return 0


def _nrows(t):
    return t.shape[0] if t.dim() else 1


def _splits(t, sizes, n):
    """Rows of t per rank: the given split sizes, or dim 0 cut evenly; None if they do not fit."""
    rows = _nrows(t)
    if sizes:
        return list(sizes) if len(sizes) == n and sum(sizes) == rows else None
    return [rows // n] * n if rows % n == 0 else None


def _rows(t, counts):
    """t (contiguous) cut into consecutive blocks of the given numbers of rows."""
    flat = t if t.dim() else t.reshape(1)
    out, start = [], 0
    for c in counts:
        out.append(flat[start : start + c])
        start += c
    return out
