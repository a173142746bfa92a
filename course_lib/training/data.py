"""The UCI handwritten digits (data/digits.csv.gz, see data/digits_SOURCE.md) and each worker's own shard of it.

Taught in notebooks/08_parameter_server.ipynb. Every worker reads only its shard; `combined_batch` is the batch a
single process would see if it took every worker's batch of that step at once (the equivalence the notebooks assert).
"""

from __future__ import annotations

import gzip
from functools import cache
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parents[2] / "data"


@cache
def _table() -> torch.Tensor:
    # Every training rank of every launch parses the table (once: a rank that loads it twice reuses it). Every
    # value is a whole number (pixels 0-16, labels 0-9); read as ints they parse in about 40 ms of CPU in a freshly
    # started rank instead of 65 as float rows, which over a notebook's dozens of launches is seconds.
    lines = gzip.decompress((DATA_DIR / "digits.csv.gz").read_bytes()).split()
    return torch.tensor([[int(v) for v in line.split(b",")] for line in lines], dtype=torch.float32)


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """1797 images as float32 rows of 64 pixels scaled to 0..1, and their labels 0-9 (int64). No network."""
    t = _table()
    return t[:, :64] / 16.0, t[:, 64].long()   # new tensors on every call: a caller may change them freely


def shard_indices(n_samples: int, worker: int, n_workers: int, seed: int = 0,
                  labels: torch.Tensor | None = None) -> torch.Tensor:
    """This worker's slice of one fixed shuffle: equal, disjoint shards (the remainder n % workers is left out).
    With `labels`, the shuffle is sorted by label first, so each worker holds about 3 of the 10 classes (non-IID)."""
    if not 0 <= worker < n_workers:
        raise ValueError(f"worker {worker} is not in 0..{n_workers - 1}")
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed))
    size = n_samples // n_workers
    if labels is None:
        return perm[worker * size:(worker + 1) * size]
    mine = perm[torch.argsort(labels[perm], stable=True)][worker * size:(worker + 1) * size]
    # shuffled within the shard, so that a batch mixes the shard's classes instead of taking them one at a time
    return mine[torch.randperm(size, generator=torch.Generator().manual_seed(seed + 1 + worker))]


def worker_batch(x: torch.Tensor, y: torch.Tensor, worker: int, n_workers: int, batch_size: int, step: int,
                 seed: int = 0, by_label: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch worker `worker` trains on at `step`: consecutive samples of its shard, wrapping round at the end
    (by_label: shards of a few classes each, notebook 11b)."""
    idx = shard_indices(len(x), worker, n_workers, seed, y if by_label else None)
    pos = torch.arange(step * batch_size, (step + 1) * batch_size) % len(idx)
    return x[idx[pos]], y[idx[pos]]


def combined_batch(x: torch.Tensor, y: torch.Tensor, n_workers: int, batch_size: int, step: int,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every worker's batch of `step`, concatenated: what one process trains on to match n synchronous workers."""
    parts = [worker_batch(x, y, w, n_workers, batch_size, step, seed) for w in range(n_workers)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
