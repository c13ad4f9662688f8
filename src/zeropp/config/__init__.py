"""Configuration: the typed sections, how they are read, and DeepSpeed's configs read as them.

- :mod:`~zeropp.config.schema`: how a section is declared (``setting``) and read from a mapping or a
  file, every key and type checked, one-line :class:`~zeropp.errors.ConfigError` otherwise;
- :mod:`~zeropp.config.policies`: ZeroConfig's grouped switches (qwZ, qgZ, offload, activation
  checkpointing), each field also accepted by its former flat key;
- :mod:`~zeropp.config.sections`: the sections (``zero``, ``topology``, ``optim``, ``train``,
  ``checkpoint``, and ``model`` from :mod:`~zeropp.config.model`), their defaults, aliases and range
  checks, ``load_config``;
- :mod:`~zeropp.config.deepspeed`: a DeepSpeed JSON config as zeropp keys (its tables in
  :mod:`~zeropp.config.deepspeed_keys`);
- :mod:`~zeropp.config.rates`: the one bandwidth parser (``200mbit``, ``10gbit``).
"""

from zeropp.config.deepspeed import translate, zero_config
from zeropp.config.model import ModelConfig
from zeropp.config.policies import ActivationCheckpointPolicy, OffloadPolicy, QuantizedGradients, QuantizedWeights
from zeropp.config.sections import (
    CheckpointConfig,
    Config,
    LossScaleConfig,
    OptimConfig,
    TopologyConfig,
    TrainConfig,
    ZeroConfig,
    load_config,
)
from zeropp.errors import ConfigError

__all__ = [
    "ActivationCheckpointPolicy",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "LossScaleConfig",
    "ModelConfig",
    "OffloadPolicy",
    "OptimConfig",
    "QuantizedGradients",
    "QuantizedWeights",
    "TopologyConfig",
    "TrainConfig",
    "ZeroConfig",
    "load_config",
    "translate",
    "zero_config",
]
