"""Pure index math, no tensors moved and no process groups: what the other layers compute positions with.

- :mod:`~zeropp.index.ranks`: the rank layout of the mesh (nodes, data- and tensor-parallel
  groups, intra- and inter-node groups, hpZ's secondary groups);
- :mod:`~zeropp.index.flat`: a unit's flat buffer (padding, shard ranges, per-parameter views,
  ``torch.chunk`` ranges, hpZ's secondary ranges, qgZ's slice order).
"""
