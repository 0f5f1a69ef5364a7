"""Data-parallel linear regression in plain numpy over plait: each rank fits its own shard of the
data, and every step averages the gradients over the ranks with one allreduce.

    python examples/numpy_data_parallel.py            # one process: a world of one
    plait-run -n 2 examples/numpy_data_parallel.py    # or torchrun --nproc-per-node 2 ...

Prints the loss every 20 steps, then checks what a user would: every rank holds the same weights
(byte for byte), and they are close to the weights that generated the data.
"""

import numpy as np

import plait

DIM, SAMPLES_PER_RANK, STEPS, LR = 16, 4096, 100, 0.1


def main():
    plait.init()
    rank, size = plait.rank(), plait.size()
    true_w = np.linspace(-1.0, 1.0, DIM)
    rng = np.random.default_rng(seed=rank)  # each rank its own shard of the data
    x = rng.standard_normal((SAMPLES_PER_RANK, DIM))
    y = x @ true_w + 0.01 * rng.standard_normal(SAMPLES_PER_RANK)
    w = np.zeros(DIM)
    for step in range(1, STEPS + 1):
        err = x @ w - y
        grad = x.T @ err / SAMPLES_PER_RANK
        plait.allreduce(grad, out=grad, op="avg")  # the mean gradient over every rank's shard
        w -= LR * grad
        if step % 20 == 0:
            loss = np.array([np.mean(err**2)])
            plait.allreduce(loss, out=loss, op="avg")
            if rank == 0:
                print(f"step {step:3d}: loss {loss[0]:.6f}", flush=True)
    every = plait.allgather(w)  # shape (size, DIM): every rank's weights
    same = all(np.array_equal(every[0], every[r]) for r in range(size))
    if rank == 0:
        print(
            f"{size} rank(s); weights identical on every rank: {same}; "
            f"max |w - true_w| = {np.abs(w - true_w).max():.4f}"
        )
    plait.finalize()


if __name__ == "__main__":
    main()
