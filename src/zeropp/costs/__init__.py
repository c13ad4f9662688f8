"""The analytic models, priced exactly as the engine allocates and the ledger records.

- :mod:`~zeropp.costs.memory`: ZeRO's Table 1 (and hpZ's secondary copy), activation checkpoints
  with Pa / Pa+cpu, and the measured peaks the formulas are checked against;
- :mod:`~zeropp.costs.volume`: every collective of a step, priced with the ledger's byte model;
- :mod:`~zeropp.costs.tensor_parallel`: what a tensor-parallel plan costs without applying it;
- :mod:`~zeropp.costs.step_time`: a step's time from its compute and its communication, overlapped.

Used by the estimator (``zeropp estimate``) and the trainer (its ZeRO-3 baseline, the summary).
"""
