"""Training batches from the self-distillation shards, with bounded memory: token arrays are
small and read whole; features stay memory-mapped and only a batch's rows are copied out.

A batch is a padded set of whole sequences (prompt + answer). Step s of a run takes sequences
[s * B, (s + 1) * B) of an endless stream of seeded epoch permutations, so a resumed run draws
the same batches as an uninterrupted one (as long as the data did not grow in between).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.loops import loop_start, loops
from tandem.train.selfdistill import answers_path, aux_path, features_path


@dataclass(frozen=True, slots=True)
class Batch:
    tokens: torch.Tensor  # [N, L] int64, padded with 0
    features: torch.Tensor  # [N, L, D] float32: the target's final-norm features (0 on padding)
    lengths: torch.Tensor  # [N] int64: real length of each sequence
    prompt_lens: torch.Tensor  # [N] int64: prompt tokens; later tokens are the target's answer
    aux: torch.Tensor | None = None  # [N, L, nD] float32: the inputs of the target's aux layers (EAGLE-3)

    def answer_mask(self, offset: int) -> torch.Tensor:
        """[N, L] bool: position j holds an answer token t_{j + offset} that exists, i.e.
        prompt_len <= j + offset < length."""
        target = torch.arange(self.tokens.shape[1])[None, :] + offset
        return (target >= self.prompt_lens[:, None]) & (target < self.lengths[:, None])


class ShardedData:
    """The sequences of some shards of `data_dir`, then of `extra` (folder, shard) pairs from
    other folders; `batch(indices)` gathers them padded. cut_loops: an answer that loops
    (tandem.loops) ends where it first repeats itself, so training spends no steps on
    copying text any draft predicts."""

    def __init__(self, data_dir: Path, shards: list[int], extra: Sequence[tuple[Path, int]] = (),
                 cut_loops: bool = False, aux_layers: tuple[int, ...] = ()):
        self.features: list[np.ndarray] = []  # per shard, memory-mapped [sum L, D]
        self.aux: list[np.ndarray] = []  # per shard, memory-mapped [sum L, nD] (aux_layers only)
        self.tokens: list[np.ndarray] = []  # per shard, [sum L]
        self.parts = [(Path(data_dir), k) for k in shards] + [(Path(d), k) for d, k in extra]
        rows = []  # (shard slot, start, length, prompt_len)
        for slot, (folder, shard) in enumerate(self.parts):
            with np.load(answers_path(folder, shard)) as z:
                tokens, lengths, prompt_lens = z["tokens"], z["lengths"], z["prompt_lens"]
            self.features.append(np.load(features_path(folder, shard), mmap_mode="r"))
            if aux_layers:
                self.aux.append(np.load(aux_path(folder, shard, aux_layers), mmap_mode="r"))
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
            rows += [(slot, int(s), int(n), int(p)) for s, n, p in zip(starts, lengths, prompt_lens)]
            self.tokens.append(tokens)
        self.rows = rows
        if cut_loops:
            self.rows = [self._cut(row) for row in rows]

    def _cut(self, row: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        slot, start, length, prompt_len = row
        answer = self.tokens[slot][start + prompt_len : start + length].tolist()
        return (slot, start, prompt_len + loop_start(answer), prompt_len) if loops(answer) else row

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def answer_tokens(self) -> int:
        return sum(n - p for _, _, n, p in self.rows)

    def sequences_in(self, folder: Path) -> int:
        slots = {slot for slot, (d, _) in enumerate(self.parts) if d == Path(folder)}
        return sum(slot in slots for slot, *_ in self.rows)

    def tokens_of(self, index: int) -> np.ndarray:
        slot, start, length, _ = self.rows[index]
        return self.tokens[slot][start : start + length]

    def answer_of(self, index: int) -> np.ndarray:
        return self.tokens_of(index)[self.rows[index][3] :]

    def batch(self, indices) -> Batch:
        picked = [self.rows[i] for i in indices]
        tokens = torch.zeros(len(picked), max(n for _, _, n, _ in picked), dtype=torch.long)
        for r, i in enumerate(indices):
            tokens[r, : len(self.tokens_of(i))] = torch.from_numpy(self.tokens_of(i).astype(np.int64))
        return Batch(tokens, _gather(self.features, picked), torch.tensor([n for *_, n, _ in picked]),
                     torch.tensor([p for *_, p in picked]), _gather(self.aux, picked) if self.aux else None)

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """[V] int64: how often each token occurs in the answers (for a pruned draft vocabulary)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for i, (_, _, _, prompt_len) in enumerate(self.rows):
            counts += np.bincount(self.tokens_of(i)[prompt_len:], minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(counts)


def _gather(arrays: list[np.ndarray], picked: list[tuple[int, int, int, int]]) -> torch.Tensor:
    """The rows of each picked sequence, [N, L, width] float32, zero-padded."""
    out = torch.zeros(len(picked), max(n for _, _, n, _ in picked), arrays[0].shape[1], dtype=torch.float32)
    for r, (slot, start, length, _) in enumerate(picked):
        out[r, :length] = torch.from_numpy(np.asarray(arrays[slot][start : start + length], dtype=np.float32))
    return out


def step_indices(step: int, batch_size: int, num_sequences: int, seed: int) -> list[int]:
    """The sequences of training step `step` (0-based): the stream of seeded per-epoch
    permutations, cut into batches of `batch_size`."""
    out = []
    position = step * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(position, num_sequences)
        perm = np.random.default_rng([seed, epoch]).permutation(num_sequences)
        take = min(batch_size - len(out), num_sequences - offset)
        out += perm[offset : offset + take].tolist()
        position += take
    return out


def eval_batches(data: ShardedData, batch_size: int, indices: Sequence[int] | None = None):
    """The held-out sequences (or those of `indices`) in order, in batches."""
    indices = list(range(len(data))) if indices is None else list(indices)
    for start in range(0, len(indices), batch_size):
        yield data.batch(indices[start : start + batch_size])
