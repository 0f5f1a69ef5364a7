"""ElasticSampler: a distributed sampler that re-partitions the not-yet-processed samples of the
epoch over the current world after each reset."""

import math

import torch

from ..mpi_ops import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()
        self.reset()

    def set_epoch(self, epoch):
        """Starts epoch `epoch` (a new order when shuffling; nothing processed yet)."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx, batch_size):
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx, batch_size):
        """Marks this rank's batch `batch_idx` (of this partition) as processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices):
        self.processed_indices.update(indices)

    def state_dict(self):
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_indices = set(state_dict["processed_indices"])
        self.reset()

    def reset(self):
        self.num_replicas, self.rank = size(), rank()
        left = [i for i in range(len(self.dataset)) if i not in self.processed_indices]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            left = [left[i] for i in torch.randperm(len(left), generator=g).tolist()]
        self.num_samples = int(math.ceil(len(left) / self.num_replicas)) if left else 0
        self.total_size = self.num_samples * self.num_replicas
        padded = left + left[: self.total_size - len(left)]
        self.remaining_indices = padded
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
