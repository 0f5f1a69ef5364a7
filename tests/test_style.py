"""The repository's formatters and linter hold: clang-format for csrc/ (.clang-format) and ruff for
the Python (pyproject's [tool.ruff]). Both come pinned with the `test` extra, so this runs wherever
the suite runs; a tool that is missing is a broken install, not a skip."""

import os
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CXX = (".cc", ".h", ".cu")


def _tool(name):
    for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(d, name)
        if os.path.exists(path):
            return path
    raise AssertionError(f"{name} is not installed next to {sys.executable}: pip install '.[test]'")


def _run(*cmd):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _sources():
    out = []
    for top, _, files in os.walk(os.path.join(ROOT, "csrc")):
        out += [os.path.relpath(os.path.join(top, f), ROOT) for f in files if f.endswith(CXX)]
    return sorted(out)


def test_cxx_is_clang_formatted():
    files = _sources()
    assert files
    r = _run(_tool("clang-format"), "--dry-run", "--Werror", *files)
    assert r.returncode == 0, "clang-format -i csrc/... would change:\n" + r.stderr[-4000:]


def test_python_is_ruff_formatted():
    r = _run(_tool("ruff"), "format", "--check", "--diff", ".")
    assert r.returncode == 0, "ruff format would change:\n" + (r.stdout + r.stderr)[-4000:]


def test_python_passes_ruff_check():
    r = _run(_tool("ruff"), "check", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
