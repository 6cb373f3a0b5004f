"""Deterministic shuffling and per-host sharding of a random-access source (grain's index sampling, without grain).

`shard_order(n, seed=s, epoch=e, shard_index=h, shard_count=k)` is the list of source indices host h reads in
epoch e: a permutation of range(n) drawn from (s, e) (the identity when seed is None), then every k-th entry
starting at h, cut to n // k entries so every host takes the same number of steps (drop_remainder). The hosts'
lists are disjoint and, without the remainder, cover range(n):

    n = 10, k = 3, no shuffle: host 0 [0, 3, 6], host 1 [1, 4, 7], host 2 [2, 5, 8]   (9 is dropped)

`ShardView(source, ...)` is that order as a source of its own (len, getitem, texts when the source has it).
`jax_shard()` is (jax.process_index(), jax.process_count()).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def shard_order(n: int, *, seed: int | None = None, epoch: int = 0, shard_index: int = 0, shard_count: int = 1,
                drop_remainder: bool = True) -> np.ndarray:
    """int64 [n // shard_count] (or the whole stride without drop_remainder): see the module docstring."""
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} / shard_count {shard_count}: need 0 <= index < count")
    order = np.arange(n, dtype=np.int64) if seed is None else \
        np.random.default_rng([int(seed), int(epoch)]).permutation(n).astype(np.int64)
    mine = order[shard_index::shard_count]
    return mine[: n // shard_count] if drop_remainder else mine


def jax_shard() -> tuple[int, int]:
    """(this process's index, process count) from JAX (multi-host training)."""
    import jax

    return jax.process_index(), jax.process_count()


class ShardView(Sequence):
    """`source` read in `shard_order(len(source), ...)` (see the module docstring)."""

    def __init__(self, source: Sequence, *, seed: int | None = None, epoch: int = 0, shard_index: int = 0,
                 shard_count: int = 1, drop_remainder: bool = True):
        self.source = source
        self.indices = shard_order(len(source), seed=seed, epoch=epoch, shard_index=shard_index,
                                   shard_count=shard_count, drop_remainder=drop_remainder)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int):
        return self.source[int(self.indices[k])]

    def texts(self, k: int):
        return self.source.texts(int(self.indices[k]))
