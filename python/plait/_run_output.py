"""Where plait-run's ranks' output goes: whole lines only (two ranks' tracebacks never mix within a
line), each prefixed with "[rank] " unless --no-prefix, shown on the console for the ranks
--local-ranks-filter keeps, and copied (unprefixed) to DIR/attempt_K/RANK/{stdout,stderr}.log with
--log-dir DIR (torchrun's layout, less its run id).
"""

import os
import subprocess
import sys
import threading


class RankOutput:
    def __init__(self, prefix, log_dir, shown):
        """prefix: bool; log_dir: a folder or None; shown: the local ranks the console shows (None:
        all)."""
        self.prefix, self.log_dir, self.shown = prefix, log_dir, shown
        self.lock = threading.Lock()
        self.threads = []

    @property
    def piped(self):
        """False: the ranks write to the launcher's own stdout and stderr (--no-prefix, no log, no
        filter)."""
        return self.prefix or self.log_dir is not None or self.shown is not None

    def env(self, env):
        if self.piped:
            env.setdefault("PYTHONUNBUFFERED", "1")  # else lines arrive only when a rank exits
        return env

    def popen_args(self):
        pipe = subprocess.PIPE if self.piped else None
        return {"stdout": pipe, "stderr": pipe}

    def attach(self, proc, rank, local, attempt):
        """Starts the threads that carry `proc`'s output (after Popen with popen_args())."""
        if not self.piped:
            return
        show = self.shown is None or local in self.shown
        folder = None
        if self.log_dir is not None:
            folder = os.path.join(self.log_dir, f"attempt_{attempt}", str(rank))
            os.makedirs(folder, exist_ok=True)
        for src, dst, name in ((proc.stdout, sys.stdout, "stdout"), (proc.stderr, sys.stderr, "stderr")):
            log = open(os.path.join(folder, f"{name}.log"), "wb") if folder else None  # noqa: SIM115
            tag = f"[{rank}] ".encode() if self.prefix else b""
            t = threading.Thread(target=self._pump, args=(src, dst if show else None, tag, log), daemon=True)
            t.start()
            self.threads.append(t)

    def _pump(self, src, dst, tag, log):
        out = getattr(dst, "buffer", None)
        try:
            for line in iter(src.readline, b""):
                if not line.endswith(b"\n"):  # a last line without its newline
                    line += b"\n"
                if log is not None:
                    log.write(line)
                    log.flush()
                if dst is None:
                    continue
                with self.lock:
                    if out is not None:
                        out.write(tag + line)
                    else:
                        dst.write((tag + line).decode(errors="replace"))
                    dst.flush()
        finally:
            src.close()
            if log is not None:
                log.close()

    def join(self, timeout=1.0):
        for t in self.threads:
            t.join(timeout=timeout)  # a rank's leftover children may hold the pipe open
        self.threads = []
