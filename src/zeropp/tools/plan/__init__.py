"""``zeropp plan``: the configurations of a training run ranked by ``zeropp simulate``'s throughput within
the GPU's memory (docs/simulate.md).

Modules: ``model`` (the models, the enumeration, :func:`plan`), ``cli`` (the flags and :func:`main`).
"""

from zeropp.tools.plan.cli import build_parser, main
from zeropp.tools.plan.model import Candidate, Model, Planned, candidates, hf_model, plan, preset_model

__all__ = ["Candidate", "Model", "Planned", "build_parser", "candidates", "hf_model", "main", "plan", "preset_model"]
