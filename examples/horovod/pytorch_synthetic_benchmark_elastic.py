"""Horovod's elastic synthetic benchmark scenario on plait.horovod: the synthetic benchmark as an
elastic job (TorchState, hvd.elastic.run, commit every --batches-per-commit batches).

    plait-run -np 3 --min-np 2 --max-np 3 examples/horovod/pytorch_synthetic_benchmark_elastic.py
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
import torch.optim as optim

import plait.horovod.torch as hvd  # was: import horovod.torch as hvd

try:
    from torchvision import models
except ImportError:
    import _models as models

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark (elastic)")
parser.add_argument(
    "--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce"
)
parser.add_argument("--model", type=str, default="resnet50", help="model to benchmark")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--image-size", type=int, default=224, help="input image side")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="warm-up batches not timed")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per benchmark iteration")
parser.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
parser.add_argument("--batches-per-commit", type=int, default=1, help="batches between state commits")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()

hvd.init()
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

model = getattr(models, args.model)()
lr_scaler = hvd.size()
optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression
)

data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % 1000


def benchmark_step(state):
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    state.batch += 1
    if state.batch % args.batches_per_commit == 0:
        state.commit()


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


@hvd.elastic.run
def run_benchmark(state):
    log("Running warmup...")
    if state.iter == 0:
        timeit.timeit(lambda: benchmark_step(state), number=args.num_warmup_batches)
    log("Running benchmark...")
    for state.iter in range(state.iter, args.num_iters):  # noqa: B020 - Horovod's idiom: resumes at the commit
        t = timeit.timeit(lambda: benchmark_step(state), number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{state.iter}: {img_sec:.1f} img/sec per CPU ({hvd.size()} ranks)")
        state.img_secs.append(img_sec)
        state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = 0.01 * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, img_secs=[], iter=0, batch=0)
state.register_reset_callbacks([on_state_reset])
run_benchmark(state)
log(f"Img/sec per CPU: {np.mean(state.img_secs):.1f} +-{1.96 * np.std(state.img_secs):.1f}")
log(f"Total img/sec on {hvd.size()} CPU(s): {hvd.size() * np.mean(state.img_secs):.1f}")
