"""Tensor (model) parallelism of a two-layer MLP in numpy over plait, Megatron-style: the first
layer's weight is split by columns, the second's by rows, so each rank computes its slice of the
hidden layer on its own and one allreduce sums the partial outputs.

    python examples/tensor_parallel.py              # one process: the whole model on one rank
    plait-run -n 2 examples/tensor_parallel.py      # hidden units split over 2 ranks

Every rank builds the full weights from the same seed and keeps only its shard; rank 0 then checks
the parallel forward pass against the unsplit one and prints the largest difference.
"""

import numpy as np

import plait

BATCH, D_IN, HIDDEN, D_OUT = 8, 64, 256, 32


def main():
    plait.init()
    rank, size = plait.rank(), plait.size()
    if HIDDEN % size:
        raise SystemExit(f"HIDDEN={HIDDEN} does not split over {size} ranks")
    rng = np.random.default_rng(seed=0)  # the same full model on every rank
    w1 = rng.standard_normal((D_IN, HIDDEN)) / np.sqrt(D_IN)
    w2 = rng.standard_normal((HIDDEN, D_OUT)) / np.sqrt(HIDDEN)
    x = rng.standard_normal((BATCH, D_IN))
    part = slice(rank * HIDDEN // size, (rank + 1) * HIDDEN // size)
    w1_shard, w2_shard = w1[:, part].copy(), w2[part, :].copy()  # what this rank keeps

    hidden = np.maximum(x @ w1_shard, 0.0)  # column parallel: this rank's hidden units
    y = hidden @ w2_shard  # row parallel: a partial sum of the output
    plait.allreduce(y, out=y)  # the full output on every rank

    # The column-parallel activations, gathered (what a following column-parallel layer skips).
    full_hidden = np.concatenate(list(plait.allgather(hidden)), axis=1)
    if rank == 0:
        want_hidden = np.maximum(x @ w1, 0.0)
        want = want_hidden @ w2
        print(
            f"{size} rank(s), {HIDDEN // size} hidden units each: "
            f"max |parallel - serial| = {np.abs(y - want).max():.2e}, "
            f"hidden layer gathered {full_hidden.shape}, equal: {np.allclose(full_hidden, want_hidden)}"
        )
    plait.finalize()


if __name__ == "__main__":
    main()
