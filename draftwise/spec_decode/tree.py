"""Token trees: the shape of a tree draft and the arithmetic every layer derives from it.

A tree draft of k guesses is given by `parents`: guess i sits in chunk row i + 1 of the verification forward (row
0 is the pending token, the root) and parents[i] is the row of its parent, always < i + 1, so parents precede
children and a chain is parents = (0, 1, ..., k - 1). From it: each row's depth (its RoPE position is the chunk's
first position + depth), its ancestor bitmask (the rows it attends inside the chunk, itself included: what
kernels/attention.py's tree op and the reference path take) and the rows of a root-to-node path (the K/V the cache
keeps after verification). Pure functions of lists; knows nothing of models, caches or proposers.
"""
from __future__ import annotations

MAX_TREE_ROWS = 64  # root + guesses: an ancestor mask is one 64-bit word


def check_parents(parents: list[int] | tuple[int, ...]) -> None:
    if len(parents) + 1 > MAX_TREE_ROWS:
        raise ValueError(f"a tree draft has at most {MAX_TREE_ROWS - 1} guesses, got {len(parents)}")
    for i, p in enumerate(parents):
        if not 0 <= p <= i:
            raise ValueError(f"guess {i} (row {i + 1}) has parent row {p}: parents must precede their children")


def depths(parents) -> list[int]:
    """[k + 1] depth of each chunk row (row 0, the root: 0)."""
    out = [0]
    for p in parents:
        out.append(out[p] + 1)
    return out


def ancestor_masks(parents) -> list[int]:
    """[k + 1] bit i of entry t set iff row i is row t or one of its ancestors (as signed int64 values)."""
    masks = [1]
    for i, p in enumerate(parents):
        masks.append(masks[p] | (1 << (i + 1)))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]


def is_chain(parents) -> bool:
    return all(p == i for i, p in enumerate(parents))


def path_rows(parents, node_row: int) -> list[int]:
    """The chunk rows from the root (0) down to `node_row`, in order."""
    rows = [node_row]
    while rows[-1] != 0:
        rows.append(parents[rows[-1] - 1])
    return rows[::-1]
