"""zeropp: ZeRO stages 1-3 for unmodified PyTorch models, on CPU (gloo) and CUDA (NCCL)."""

from zeropp.comm import Communicator, Ledger
from zeropp.config import Config, ConfigError, ZeroConfig, load_config
from zeropp.engine import ZeroEngine
from zeropp.pretrained import load_pretrained
from zeropp.tensor_parallel import parallelize
from zeropp.topology import Topology, init_topology, shutdown

__all__ = [
    "Communicator",
    "Config",
    "ConfigError",
    "Ledger",
    "Topology",
    "ZeroConfig",
    "ZeroEngine",
    "init_topology",
    "load_config",
    "load_pretrained",
    "parallelize",
    "shutdown",
]
