"""A capture's BlockStored events as the trace a replay takes: each event one request's lookup, its chain
from the root (the stored blocks after their cached ancestors, found through parent hashes), in arrays,
one replica's columns at a time (the Spark job replays each replica with the same function)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..whatif import Trace


def capture_trace(part: pd.DataFrame) -> Trace:
    """Each event's lookup: the ancestors of its first block (through parent hashes, to the root), then its
    blocks; in arrays: a block hash names its whole prefix, so the hashes are the keys (made dense)."""
    hashes = part.block_hash.to_numpy()
    starts = event_starts(part)
    _, key, parent, _ = block_tree(part)
    depth = depths(parent)  # ancestors of each block
    head = parent[key[starts]]  # the block each event continues (-1: the root)
    up = np.where(head >= 0, depth[head.clip(0)] + 1, 0)
    own = np.diff(np.r_[starts, len(hashes)])
    offsets = np.zeros(len(starts) + 1, np.int64)
    np.cumsum(up + own, out=offsets[1:])
    keys = np.empty(offsets[-1], np.int64)
    at, cur = offsets[:-1] + up - 1, head.copy()  # ancestors, filled from the nearest up
    while (live := cur >= 0).any():
        keys[at[live]] = cur[live]
        at, cur = at - 1, np.where(live, parent[cur.clip(0)], -1)
    fill = np.repeat(offsets[:-1] + up - starts, own) + np.arange(len(hashes))
    keys[fill] = key
    bs = int(part.block_size.iloc[0]) if len(part) else 16
    n = len(starts)
    return Trace(timestamp=np.zeros(n), input_length=(up + own) * bs, output_length=np.zeros(n, np.int64),
                 offsets=offsets, keys=keys, block_size=bs)


def event_starts(part: pd.DataFrame) -> np.ndarray:
    """The first row of each event (a request's lookup)."""
    step, event = part.step.to_numpy(), part.event_index.to_numpy()
    return np.flatnonzero(np.r_[True, (np.diff(step) != 0) | (np.diff(event) != 0)])


def block_tree(part: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The blocks as a forest: the distinct hashes (sorted: a block's key is its place), each row's key,
    each key's parent key (-1 at a chain's first block or where the parent is not in the capture), and
    whether the row that first stored the block began a chain (root: no parent hash)."""
    hashes, parents, roots = part.block_hash.to_numpy(), part.parent_hash.to_numpy(), part.root.to_numpy()
    uniq, key = np.unique(hashes, return_inverse=True)
    # each block's parent, from the row that first stored it: a row's parent hash, or the row before it
    first = np.unique(key, return_index=True)[1]
    named = np.searchsorted(uniq, parents).clip(0, len(uniq) - 1)
    known = ~roots & (uniq[named] == parents)
    parent = np.full(len(uniq), -1, np.int64)
    parent[key[first]] = np.where(known, named, -1)[first]
    return uniq, key, parent, roots[first].astype(bool)


def depths(parent: np.ndarray) -> np.ndarray:
    """How many ancestors each node of a forest has, by pointer doubling: each round adds the count of the
    node it jumps to and jumps twice as far, so the deepest chain takes log2 of its length in rounds."""
    depth, jump = (parent >= 0).astype(np.int64), parent.copy()
    while (live := jump >= 0).any():
        depth = depth + np.where(live, depth[jump.clip(0)], 0)
        jump = np.where(live, jump[jump.clip(0)], -1)
    return depth
