"""The mask rows a target step samples and verifies with (torch; the target's side).

A row is a bool [V] of the tokens the grammar allows at one position. For a chain of k drafts
rows 0..k come from walking the drafts with the sequence's matcher (fill, validate, consume),
then rolling back; for a tree, one row per node by a depth-first walk with a rollback after each
child. A row after a draft the grammar refuses is never reached (that draft has target
probability 0 under the mask, so it is rejected): it is left all-allowed, never all-refused,
which would make its softmax NaN.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tandem.structured.matcher import SequenceGrammar



def new_bitmask(rows: int, vocab_size: int) -> Tensor:
    """[rows, ceil(V / 32)] int32, every bit set (all allowed)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_row(grammar: SequenceGrammar, bitmask: Tensor, row: int) -> None:
    words = bitmask[row]
    assert words.is_contiguous() and words.dtype == torch.int32
    grammar.matcher.fill_bitmask(words.data_ptr(), words.numel() * 4)


def unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[R, W] int32 words -> [R, V] bool, bit t of word t // 32 for token t."""
    # numpy's unpackbits, one thread: torch's shifts over [R, W, 32] took 4 ms for 5 rows of a
    # 49k vocabulary while a forward pass held the intra-op threads, this 0.1 ms.
    assert sys.byteorder == "little"  # word t // 32's byte (t % 32) // 8 holds bit t % 8
    bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(bits[:, :vocab_size].view(np.bool_))


def chain_masks(grammar: SequenceGrammar, drafts: Sequence[int], vocab_size: int) -> Tensor:
    """[k + 1, V] bool: row j allows what may follow the drafts d_1..d_j. The grammar stands
    where it stood before."""
    bitmask = new_bitmask(len(drafts) + 1, vocab_size)
    walked = len(grammar.history)
    for j in range(len(drafts) + 1):
        fill_row(grammar, bitmask, j)
        if j == len(drafts) or not grammar.accept(drafts[j]):
            break
    grammar.rollback_to(walked)
    return unpack(bitmask, vocab_size)


def tree_masks(grammar: SequenceGrammar, tokens: Sequence[int], parents: Sequence[int], vocab_size: int) -> Tensor:
    """[N, V] bool: row i allows what may follow the path to node i. tokens: the N node tokens
    (node 0, the root, is the last emitted token, which the grammar already stands after);
    parents: the parent of nodes 1..N-1, parents before children."""
    children: list[list[int]] = [[] for _ in tokens]
    for node, parent in enumerate(parents, start=1):
        children[parent].append(node)
    bitmask = new_bitmask(len(tokens), vocab_size)
    base = len(grammar.history)
    stack = [(0, len(grammar.history))]
    while stack:  # depth first: a node's row is filled while the grammar stands after its path
        node, depth = stack.pop()
        grammar.rollback_to(depth)
        if node and not grammar.accept(tokens[node]):
            continue
        fill_row(grammar, bitmask, node)
        stack.extend((c, len(grammar.history)) for c in reversed(children[node]))
    grammar.rollback_to(base)
    return unpack(bitmask, vocab_size)
