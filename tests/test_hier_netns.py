"""Two simulated hosts in separate network namespaces joined by a veth link: plait-run --nnodes 2 in
each, gloo between them over the veth (not loopback). Needs root and iproute2; skips otherwise."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_run import _ENV, script
from test_run_multinode import PROGRAM

pytestmark = pytest.mark.slow  # minutes of multi-process runs: full suite only

pytest.importorskip("torch")


def _ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def namespaces():
    """[(namespace, interface, address)] x 2, removed afterwards (with their veth pair)."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    tag = f"{os.getpid() % 100000}"
    names = [f"plait-{tag}-{k}" for k in range(2)]
    devs = [f"plv{tag}{k}" for k in range(2)]
    net = f"10.{213 + os.getpid() % 40}.{os.getpid() % 250}"
    r = _ip("netns", "add", names[0])
    if r.returncode:
        pytest.skip(
            f"cannot create network namespaces here ({r.stderr.strip() or r.returncode}); "
            f"the PLAIT_HOST_ID tests cover the same code paths over loopback"
        )
    try:
        steps = [
            ("netns", "add", names[1]),
            ("link", "add", devs[0], "type", "veth", "peer", "name", devs[1]),
        ]
        for k in range(2):
            steps += [
                ("link", "set", devs[k], "netns", names[k]),
                ("-n", names[k], "addr", "add", f"{net}.{k + 1}/24", "dev", devs[k]),
                ("-n", names[k], "link", "set", devs[k], "up"),
                ("-n", names[k], "link", "set", "lo", "up"),
            ]
        for s in steps:
            r = _ip(*s)
            if r.returncode:
                pytest.skip(f"cannot set up the veth link (ip {' '.join(s)}: {r.stderr.strip()})")
        yield [(names[k], devs[k], f"{net}.{k + 1}") for k in range(2)]
    finally:
        for n in names:
            _ip("netns", "del", n)


def test_two_hosts_over_a_veth_link(tmp_path, namespaces):
    prog = script(tmp_path, PROGRAM)
    master = namespaces[0][2]
    procs = []
    for node, (ns, dev, _) in enumerate(namespaces):
        env = dict(_ENV, PLAIT_HOST_ID=f"ns{node}", GLOO_SOCKET_IFNAME=dev)
        cmd = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "plait.run",
            "--nnodes",
            "2",
            "--node-rank",
            str(node),
            "--master-addr",
            master,
            "--master-port",
            "29400",
            "-n",
            "2",
            str(prog),
            str(tmp_path),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    for r in range(4):
        rec = json.loads((tmp_path / f"rank-{r}.json").read_text())
        assert rec["kind"] == "HierCommunicator" and rec["PLAIT_STORE"] == f"{master}:29401"
        assert rec["sum"] == [10 * k for k in range(5)] and rec["gather"] == [0, 1, 2, 3]
