"""Where plait.horovod's ops run on CUDA tensors, and the CUDA calls that order them.

A CUDA tensor's op runs on plait's GPU path (the communicator's GPU queue: NCCL between the ranks'
GPUs, or CUDA IPC when they share one), as Horovod runs its GPU ops through NCCL. The ordering is
Horovod's:
  - submission records a *ready* event on the submitting thread's current stream of the tensor's
    device (the stream that produced the tensor);
  - the coordinator runs the op on a stream of its own per device, which first waits for the ready
    events of the op's tensors; copies into and out of a GPU fusion buffer, the scale factors and
    plait's collective are all enqueued there;
  - a *done* event is recorded after the op's last copy out, and synchronize() (the waiting
    thread) blocks on it, so the outputs are final on the host's return, on every stream.
Everything the coordinator needs of CUDA goes through `layer` (a CudaLayer): one place to read,
and the seam tests replace to drive the GPU logic under a CPU-only torch.
"""

import contextlib

CPU = -1


def _torch():
    import torch

    return torch


class CudaLayer:
    def __init__(self):
        self._streams = {}  # device -> the coordinator's stream there
        self._buffers = {}  # device -> uint8 fusion buffer

    def index(self, t):
        """-1 for a CPU tensor, the device index of a CUDA tensor; TypeError for other devices."""
        if t.is_cpu:  # without making a torch.device: this runs for every op
            return CPU
        kind = t.device.type
        if kind == "cpu":
            return CPU
        if kind == "cuda":
            return t.device.index if t.device.index is not None else _torch().cuda.current_device()
        raise TypeError(f"plait.horovod runs ops on CPU and CUDA tensors, got one on {t.device}")

    def device(self, index):
        """The torch.device of an index (-1: the CPU)."""
        torch = _torch()
        return torch.device("cpu") if index < 0 else torch.device("cuda", index)

    def current(self):
        """The device a joined rank makes its zeros on when its join() named none."""
        return _torch().cuda.current_device()

    def ready(self, index):
        """An event on the submitting thread's current stream of the device."""
        torch = _torch()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(index))
        return ev

    def stream(self, index):
        """A context that makes the coordinator's stream on the device current."""
        torch = _torch()
        s = self._streams.get(index)
        if s is None:
            s = self._streams[index] = torch.cuda.Stream(device=index)
        return torch.cuda.stream(s)

    def wait(self, event):
        """The current stream waits for event (a ready event) without blocking the host."""
        _torch().cuda.current_stream().wait_event(event)

    def buffer(self, index, nbytes):
        """The fusion buffer of the device: at least nbytes, uint8, kept between cycles."""
        buf = self._buffers.get(index)
        if buf is None or buf.numel() < nbytes:
            buf = self._buffers[index] = _torch().empty(
                max(nbytes, 1 << 16), dtype=_torch().uint8, device=self.device(index)
            )
        return buf[:nbytes]

    def done(self, index):
        """An event after everything enqueued so far on the current stream of the device."""
        torch = _torch()
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(index))
        return ev

    def synchronize(self, event):
        """The host waits for the event."""
        event.synchronize()

    def clear(self):
        self._buffers.clear()


layer = CudaLayer()


@contextlib.contextmanager
def on_device(index, ops):
    """Runs the enclosed executor work on the coordinator's stream of the device, after the
    ready events of this rank's ops (None for a rank that joined)."""
    if index < 0:
        yield
        return
    with layer.stream(index):
        for o in ops:
            if o is not None and o.ready is not None:
                layer.wait(o.ready)
                o.ready = None
        yield
