"""The runtime: what happens to the units during a training step, between the engine's user API and
the units' buffers (FSDP2 draws the same line between its state and its parameter groups).

- :mod:`~zeropp.runtime.hooks`: the module and gradient hooks, and the backward pass around them;
- :mod:`~zeropp.runtime.order`: the execution order recorded in the first step, and prefetch;
- :mod:`~zeropp.runtime.reductions`: the queue of gradient reductions in flight during backward;
- :mod:`~zeropp.runtime.activation_checkpointing`: activation checkpointing per block, ZeRO-R's Pa, Pa+cpu, MD.
"""

from zeropp.runtime.hooks import Runtime

__all__ = ["Runtime"]
