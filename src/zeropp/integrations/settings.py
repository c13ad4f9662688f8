"""The engine's ZeroConfig for a host training loop: the user's zeropp or DeepSpeed settings, with
accumulation, clipping and precision taken from the host's own flags (the Trainer's
``TrainingArguments``, Lightning's ``Trainer`` arguments)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from zeropp.config import deepspeed
from zeropp.config.sections import ZeroConfig, load_config
from zeropp.errors import ZeroppError

logger = logging.getLogger(__name__)

ZeroSource = ZeroConfig | Mapping[str, Any] | str | os.PathLike | None


class IntegrationError(ZeroppError, ValueError):
    """A host-loop setting zeropp cannot honour (one line)."""


def resolve_zero_config(
    source: ZeroSource,
    wanted: Mapping[str, Any],
    *,
    owner: str,
    world_size: int,
    hidden_size: int | None = None,
    micro_batch_size: int | None = None,
) -> ZeroConfig:
    """`source` (a ZeroConfig; a dict of zeropp ``zero`` keys; a DeepSpeed JSON path or a dict with
    ``zero_optimization``) with `wanted`'s ZeroConfig values (``owner``'s flags). A value `source` sets
    explicitly and `wanted` contradicts is refused in one line; so is a DeepSpeed micro-batch size
    other than `micro_batch_size` (when the host knows it)."""
    defaults = ZeroConfig()
    if source is None:
        zero, where = defaults, "zero_config"
    elif isinstance(source, ZeroConfig):
        zero, where = source, "zero_config"
    elif isinstance(source, Mapping) and "zero_optimization" not in source:
        zero, where = load_config({"zero": dict(source)}).zero, "zero_config"
    else:  # a DeepSpeed config: "auto" and the keys it leaves out take the host's values
        batch = {} if micro_batch_size is None else {"train.micro_batch_size": micro_batch_size}
        base = load_config(None, {**batch, **{f"zero.{k}": v for k, v in wanted.items()}})
        config = deepspeed.translate(source, world_size=world_size, hidden_size=hidden_size, base=base).config(base)
        if micro_batch_size is not None and config.train.micro_batch_size != micro_batch_size:
            raise IntegrationError(
                f"the DeepSpeed config's train_micro_batch_size_per_gpu {config.train.micro_batch_size} is not "
                f'{owner}\' per-device batch size {micro_batch_size}; make them agree or write "auto"'
            )
        if any(key in deepspeed.read(source) for key in ("optimizer", "scheduler")):
            logger.warning("zeropp: the DeepSpeed config's optimizer and scheduler are replaced by %s'", owner)
        if config.topology.tensor_parallel_size > 1:  # the host loop wraps one model replica per rank
            raise IntegrationError(
                f"the DeepSpeed config's tensor_parallel.autotp_size = {config.topology.tensor_parallel_size}: "
                f"{owner} do not split the model; train it with zeropp train --deepspeed, which does"
            )
        defaults, zero, where = base.zero, config.zero, "the DeepSpeed config"
    for key, value in wanted.items():
        mine = getattr(zero, key)
        if mine != value and mine != getattr(defaults, key):
            raise IntegrationError(f"{where} sets {key} {mine!r} but {owner} say {value!r}; make them agree")
    return dataclasses.replace(zero, **wanted)
