"""An elastic job for tests/test_horovod_launch.py: 30 committed steps of SGD on a loss whose
gradient is 1 on every rank, so the averaged gradient is 1 whatever the world size and the weight
after the job is exactly w0 - 30 * lr when every step was applied exactly once (a restore that
lost or repeated a step would show). HVD_TEST_KILL=<worker id>:<batch> makes that worker SIGKILL
itself at that batch, on its first life only. HVD_TEST_REGROW=N: after the kill, go on past 30
steps until the world is back to N ranks (a replacement the launcher started has joined) and has
taken 5 steps at that size."""

import json
import os
import signal
import time

import torch

import plait.horovod.torch as hvd

LR, STEPS = 0.125, 30
assert (10.0 - 2000 * LR) == -240.0  # every weight on the way is exact in float64

hvd.init()
model = torch.nn.Linear(1, 1, bias=False).double()
torch.nn.init.constant_(model.weight, 10.0)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=LR), named_parameters=model.named_parameters()
)
state = hvd.elastic.TorchState(model, opt, batch=0, sizes=[])
resets = []
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
kill = os.environ.get("HVD_TEST_KILL", "")
me = os.environ.get("PLAIT_WORKER_ID")


regrow = int(os.environ.get("HVD_TEST_REGROW", "0"))


def more(state):
    if state.batch < STEPS:
        return True
    if regrow and state.batch < 2000:
        return state.sizes[-5:] != [regrow] * 5 or min(state.sizes) == regrow
    return False


@hvd.elastic.run
def train(state):
    while more(state):
        opt.zero_grad()
        model(torch.ones(1, 1, dtype=torch.float64)).sum().backward()
        opt.step()
        if kill == f"{me}:{state.batch}":
            os.kill(os.getpid(), signal.SIGKILL)
        state.sizes.append(hvd.size())
        state.batch += 1
        state.commit()
        time.sleep(0.05)


train(state)
weights = hvd.allgather_object(float(model.weight.item()))
if hvd.rank() == 0:
    result = {"weights": weights, "sizes": state.sizes, "resets": resets, "batch": state.batch}
    print("RESULT " + json.dumps(result), flush=True)
hvd.shutdown()
