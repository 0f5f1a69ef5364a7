"""PyTorch's own distributed tests (TestDistBackend with DistributedTest._DistTestBase, from
torch/testing/_internal/distributed/distributed_test.py) against backend "plait".

    PYTHONPATH=python python tests/torch_suite.py -k all_reduce -k broadcast   # a subset
    PYTHONPATH=python python tests/torch_suite.py                              # all (hours here)

Every test spawns WORLD_SIZE (default 2) processes, which import this file: the setup below is
at module level for them. Prints each outcome and the pass / fail / error / skip counts. Not a
pytest file (its name does not start with test_): it is a report, and many of torch's tests
assume gloo or NCCL (names, CUDA, gloo-only APIs).
"""

import os
import sys
import tempfile
import unittest

os.environ.setdefault("BACKEND", "plait")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="plait-torch-suite-"))

import plait.torch  # noqa: F401  (registers "plait" here and in every spawned rank)
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)


class TestPlait(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


def main():
    patterns = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "-k"]
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = [f"*{p}*" for p in patterns]
    suite = loader.loadTestsFromTestCase(TestPlait)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    skipped = len(result.skipped)
    failed, errors = len(result.failures), len(result.errors)
    passed = result.testsRun - skipped - failed - errors - len(result.expectedFailures)
    print(
        f"torch distributed_test against plait: {result.testsRun} run, {passed} passed, {failed} failed, "
        f"{errors} errors, {skipped} skipped"
    )
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main())
