"""The embedded corpus and its byte-level batches.

The corpus is the King James Version of the Bible (1611, public domain), taken as plain text from
Debian's ``bible-kjv-text`` package with verse references removed, gzip-compressed (1.2 MB).
Tokens are bytes (vocabulary 256). The last 5% of the text is the validation split. Your own text
(``zeropp train --data``) is read and tokenized by :mod:`zeropp.app.data.text` and split by the same rule.
"""

from __future__ import annotations

import gzip
from functools import lru_cache
from importlib import resources

import torch

VAL_FRACTION = 0.05


@lru_cache(maxsize=1)
def corpus_bytes() -> bytes:
    return gzip.decompress(resources.files(__package__).joinpath("kjv.txt.gz").read_bytes())


def split_tokens(split: str) -> torch.Tensor:
    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8)
    cut = int(len(data) * (1 - VAL_FRACTION))
    return data[:cut] if split == "train" else data[cut:]


class Batches:
    """Deterministic batches: the global batch of a step depends only on (seed, split, step).

    Every rank draws the same global batch of ``world * micro_batch`` sequences and keeps its own
    rows, so training at any world size sees exactly what one process would on the whole batch.
    """

    def __init__(
        self,
        split: str,
        block_size: int,
        micro_batch: int,
        world: int,
        rank: int,
        seed: int,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """`tokens`: the split's token ids (default: the embedded corpus's `split`)."""
        self.tokens = (split_tokens(split) if tokens is None else tokens).long()
        self.block_size, self.micro_batch, self.world, self.rank, self.seed = block_size, micro_batch, world, rank, seed
        self.split_salt = 0 if split == "train" else 1

    def global_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(hash((self.seed, self.split_salt, step, micro)) & 0x7FFF_FFFF)
        starts = torch.randint(
            len(self.tokens) - self.block_size - 1, (self.world * self.micro_batch,), generator=generator
        )
        rows = torch.stack([self.tokens[s : s + self.block_size + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def local_batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.global_batch(step, micro)
        rows = slice(self.rank * self.micro_batch, (self.rank + 1) * self.micro_batch)
        return x[rows], y[rows]
