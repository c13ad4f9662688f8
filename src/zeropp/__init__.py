"""zeropp: ZeRO stages 1-3 and ZeRO++ for unmodified PyTorch models, on CPU (gloo) and CUDA (NCCL).

The packages, each importing only the ones before it (``tests/test_layers.py`` keeps it so):
``errors`` · ``config`` · ``index`` (pure rank and flat-buffer math) · ``topology`` · ``quant`` ·
``comm`` · ``zero`` (the ZeRO core) · ``runtime`` · ``tensor_parallel`` · ``context_parallel``
(Ulysses) · ``costs`` (the analytic models) · ``checkpoint`` · ``engine`` · ``integrations``
(``ZeroTrainer``: the Hugging Face Trainer; not imported here) · ``app`` (``zeropp train``) ·
``tools`` (estimate, cluster, bench) · ``cli``.
"""

from zeropp.checkpoint.pretrained import load_pretrained
from zeropp.comm.communicator import Communicator
from zeropp.comm.ledger import Ledger
from zeropp.config.deepspeed import zero_config as zero_config_from_deepspeed
from zeropp.config.policies import ActivationCheckpointPolicy, OffloadPolicy, QuantizedGradients, QuantizedWeights
from zeropp.config.sections import Config, TopologyConfig, ZeroConfig, load_config
from zeropp.context_parallel import causal_lm_inputs, sequence_positions, split_sequence
from zeropp.engine import ZeroEngine
from zeropp.errors import ConfigError, ZeroppError
from zeropp.runtime.tiled_logits import tiled_cross_entropy
from zeropp.tensor_parallel.apply import parallelize
from zeropp.topology import Topology, init_topology, shutdown

__all__ = [
    "ActivationCheckpointPolicy",
    "Communicator",
    "Config",
    "ConfigError",
    "Ledger",
    "OffloadPolicy",
    "QuantizedGradients",
    "QuantizedWeights",
    "Topology",
    "TopologyConfig",
    "ZeroConfig",
    "ZeroEngine",
    "ZeroppError",
    "causal_lm_inputs",
    "init_topology",
    "load_config",
    "load_pretrained",
    "parallelize",
    "sequence_positions",
    "shutdown",
    "split_sequence",
    "tiled_cross_entropy",
    "zero_config_from_deepspeed",
]
