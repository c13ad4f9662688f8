"""Block quantization for ZeRO++ (qwZ's weights, qgZ's gradients).

- :mod:`~zeropp.quant.spec`: the format (``QuantSpec``, ``Quantized``, int4 packing, the rounding
  rule) and the ``QuantKernels`` API;
- :mod:`~zeropp.quant.reference`: the torch implementation, on every device
  (its temporaries: :mod:`~zeropp.quant.scratch`);
- :mod:`~zeropp.quant.hadamard`: qgZ's seeded random Hadamard rotation of blocks;
- :mod:`~zeropp.quant.triton`: the Triton kernels of all of the above;
- :mod:`~zeropp.quant.backends`: the backends as records, and the choice among them.
"""

from zeropp.quant.backends import Backend, backend_for, backend_of, kernels_for
from zeropp.quant.spec import Quantized, QuantKernels, QuantSpec, pack_int4, unpack_int4

__all__ = [
    "Backend",
    "QuantKernels",
    "QuantSpec",
    "Quantized",
    "backend_for",
    "backend_of",
    "kernels_for",
    "pack_int4",
    "unpack_int4",
]
