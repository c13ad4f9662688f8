"""Your own text for ``zeropp train --data PATH``: read, tokenized and split, the same on every rank.

PATH is a plain text file (one document), a folder (every file under it, in sorted path order, one
document each; hidden files skipped; ``.jsonl`` files read as below), or a ``.jsonl`` file (one JSON
object a line, its ``text`` field a document; blank lines skipped). Text is UTF-8.

Tokens: UTF-8 bytes by default (vocabulary 256, documents joined by a newline), or a local Hugging
Face tokenizer (``--tokenizer DIR``, no special tokens added; documents joined by its EOS token
when it has one). Split, deterministically: the documents' tokens in order, the last 5% of them
(:data:`zeropp.app.data.VAL_FRACTION`) the validation split, as for the embedded corpus.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from zeropp.app.data.batches import VAL_FRACTION
from zeropp.errors import ConfigError


class DataError(ConfigError):
    """Data that cannot be trained on (missing, empty, malformed, too short). One line."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: the embedded GPT's vocabulary."""

    vocab_size = 256
    separator = list(b"\n")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer behind the same face as :class:`ByteTokenizer`."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        eos = tokenizer.eos_token_id
        self.separator = [] if eos is None else [eos]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def documents(path: str | Path) -> Iterator[tuple[str, str]]:
    """(where, text) of every document under `path` (see the module docstring); DataError in one line."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"--data {str(path)!r} does not exist; expected a text file, a folder of them, or a .jsonl file"
        )
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
        for file in files:
            yield from _file_documents(file)
    else:
        yield from _file_documents(path)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _file_documents(file: Path) -> Iterator[tuple[str, str]]:
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"--data file {str(file)!r} is not UTF-8 text (byte {error.start})") from None
    except OSError as error:
        raise DataError(f"--data file {str(file)!r} cannot be read ({error.strerror})") from None
    if file.suffix != ".jsonl":
        yield str(file), text
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"--data {where} is not JSON ({error.msg}); expected one object a line") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'--data {where} has no string field \'text\'; expected objects like {{"text": "..."}}')
        yield where, record["text"]


def tokenize(path: str | Path, tokenizer: ByteTokenizer | HFTokenizer) -> torch.Tensor:
    """Every document's tokens in order, joined by the tokenizer's separator (int64)."""
    ids: list[int] = []
    for _, text in documents(path):
        if text:
            ids.extend([*tokenizer.separator, *tokenizer.encode(text)] if ids else tokenizer.encode(text))
    if not ids:
        raise DataError(f"--data {str(path)!r} holds no text")
    return torch.tensor(ids, dtype=torch.int64)


def split(tokens: torch.Tensor, block_size: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last VAL_FRACTION of the tokens is validation; each split must hold a
    sequence of block_size + 1 tokens and one more to draw from."""
    cut = int(len(tokens) * (1 - VAL_FRACTION))
    train, val = tokens[:cut], tokens[cut:]
    need = block_size + 2
    if min(len(train), len(val)) < need:
        least = int(need / VAL_FRACTION) + 1
        raise DataError(
            f"--data {where} holds {len(tokens)} tokens: too few for sequences of {block_size} (the validation "
            f"split, the last {VAL_FRACTION:.0%}, needs {need}); give at least {least} tokens or a smaller --block-size"
        )
    return train, val


def text_splits(
    path: str | Path, tokenizer: ByteTokenizer | HFTokenizer, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The train and validation token ids of `path`."""
    return split(tokenize(path, tokenizer), block_size, repr(str(path)))
