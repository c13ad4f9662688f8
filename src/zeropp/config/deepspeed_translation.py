"""What a DeepSpeed config sets, as :mod:`zeropp.config.deepspeed` reads it: the zeropp overrides, the
file's key and value behind each (so that a later error names the key as the file wrote it), the one
note line, and the train_batch_size check."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from zeropp.config.sections import Config, load_config
from zeropp.errors import ConfigError


@dataclass
class Translation:
    """What a DeepSpeed config sets: zeropp overrides (dotted keys), the file's key and value behind each
    (`sources`), the keys noted, the "auto" values resolved, and the train_batch_size to check the final
    config against."""

    overrides: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, tuple[str, Any]] = field(default_factory=dict)
    noted: list[str] = field(default_factory=list)
    resolved: dict[str, Any] = field(default_factory=dict)
    train_batch_size: int | None = None
    world_size: int = 1  # the ranks reading different rows, which the batch sizes count

    def note(self) -> str | None:
        """One line for the user: the keys accepted without effect and the "auto" values resolved."""
        parts = []
        if self.noted:
            parts.append(f"accepted without effect here: {', '.join(self.noted)}")
        if self.resolved:
            parts.append("auto: " + ", ".join(f"{k} = {v}" for k, v in self.resolved.items()))
        return f"DeepSpeed config: {'; '.join(parts)}" if parts else None

    def check_batch(self, config: Config) -> None:
        """Refuse a final config (after the flags) whose global batch is not train_batch_size."""
        if self.train_batch_size is not None:
            micro, steps = config.train.micro_batch_size, config.zero.gradient_accumulation_steps
            check_total(self.train_batch_size, micro, steps, self.world_size)

    def config(self, base: Config | Mapping[str, Any] | None = None) -> Config:
        """The Config these overrides give on top of `base` (a Config, a dict, or the defaults)."""
        source = dataclasses.asdict(base) if isinstance(base, Config) else base
        with self.worded():
            config = load_config(source, self.overrides)
        self.check_batch(config)
        return config

    @contextlib.contextmanager
    def worded(self) -> Iterator[None]:
        """Reword a ConfigError about a zeropp key this file set to the value it has from the file: it
        names the file's key and value, then the zeropp key, then what is allowed."""
        try:
            yield
        except ConfigError as error:
            if error.key not in self.sources or self.overrides.get(error.key) != error.value:
                raise
            written, value = self.sources[error.key]
            why = str(error).removeprefix(f"{error.key} = {error.value!r} ")
            raise ConfigError(f"DeepSpeed {written} = {shown(value)} (zeropp's {error.key}) {why}") from None


def check_total(total: int, micro: int, steps: int, world: int) -> None:
    if micro * steps * world != total:
        raise ConfigError(
            f"DeepSpeed train_batch_size = {total} is not allowed; expected micro-batch {micro} x gradient "
            f"accumulation {steps} x {world} ranks = {micro * steps * world}"
        )


def shown(value: Any) -> str:
    """A value as the file writes it, cut to one short line."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:56] + " ..."
