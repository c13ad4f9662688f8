"""``zeropp estimate``: per-rank memory of model states and per-step communication, without running anything.

Three models (derivations, paper references and the reproduced tables: docs/estimate.md):

- **Memory** of model states per rank: :func:`zeropp.costs.memory.analytic_model_state_bytes` (ZeRO Table 1,
  hpZ's secondary copy), per unit, on the padded unit sizes the engine allocates; with tensor
  parallelism on one tensor-parallel rank's share, over the data-parallel ranks. Activation
  checkpoints per rank (ZeRO-R: Pa, Pa+cpu): :class:`zeropp.costs.memory.Activations`.
- **Communication**: every collective the engine issues in one optimizer step, priced with the ledger's
  byte model (comm/ledger.py), so the estimate is what the ledger records: exactly, unit for unit
  (:mod:`zeropp.costs.volume`, the same model ``zeropp train`` prices its ZeRO-3 baseline with). The
  model is given as Ψ (one flat unit) or as the numel of every unit; padding follows
  :class:`~zeropp.index.flat.FlatLayout`. Left out: the one-off broadcast of the initial weights,
  evaluation, and fp16 steps skipped for overflow (they gather no updated weights). Under DiLoCo's
  outer loop (``--outer-sync-every H``) ZeRO runs inside each node and the synchronization's exchange
  is priced per sync and, spread over its H steps, per step.
- **Time**: intra-node bytes of the busiest rank / intra-node bandwidth + bytes leaving one node /
  inter-node bandwidth, summed over the step's collectives with no overlap (neither between collectives
  nor between the two kinds of link). The inter-node bandwidth is a node's (its ranks share it), the
  intra-node one a rank's.

Modules: ``model`` (units, :class:`Estimate`, :func:`estimate`), ``papers`` (the papers' tables),
``show`` (printing), ``cli`` (``zeropp estimate``'s flags and :func:`main`).
"""

from zeropp.config.rates import parse_bandwidth
from zeropp.config.sections import ZEROPP_SWITCHES
from zeropp.costs.volume import Transfer, ring_crossing
from zeropp.tools.estimate.cli import build_parser, main
from zeropp.tools.estimate.gpt import gpt_activations, gpt_unit_numels
from zeropp.tools.estimate.model import Estimate, Unit, estimate
from zeropp.tools.estimate.papers import (
    ZERO_TABLE_DP,
    hpz_example,
    max_model_table,
    mp_example,
    pa_example,
    paper_gb,
    trillion_example,
    zero_table,
    zeropp_table,
)

__all__ = [
    "ZERO_TABLE_DP",
    "ZEROPP_SWITCHES",
    "Estimate",
    "Transfer",
    "Unit",
    "build_parser",
    "estimate",
    "gpt_activations",
    "gpt_unit_numels",
    "hpz_example",
    "main",
    "max_model_table",
    "mp_example",
    "pa_example",
    "paper_gb",
    "parse_bandwidth",
    "ring_crossing",
    "trillion_example",
    "zero_table",
    "zeropp_table",
]
