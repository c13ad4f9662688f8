"""The ZeRO core: a unit's flat buffers and states, and how the stages differ (as policy).

- :mod:`~zeropp.zero.unit`: ``FlatUnit``, a unit's flat buffers (master, compute, gradient, hpZ
  secondary), its two state enums, gather / reshard / reduce;
- :mod:`~zeropp.zero.options`: ``UnitOptions``, how every unit stores and communicates, derived once;
- :mod:`~zeropp.zero.stages`: ZeRO stages 0-3 as a policy;
- :mod:`~zeropp.zero.grouping`: which modules form units and which parameters each owns;
- :mod:`~zeropp.zero.materialize`: a model brought onto the ranks one unit at a time;
- :mod:`~zeropp.zero.weights.dtensor_params`: DTensor parameters as one rank holds them;
- :mod:`~zeropp.zero.arena`: memory for gradient buffers and checkpoint pieces (MD);
- :mod:`~zeropp.zero.precision`: compute dtypes, fp16 dynamic loss scaling;
- :mod:`~zeropp.zero.fingerprint`: every rank built the same model.
"""
