"""The Triton kernels of :mod:`zeropp.quant` (an optional extra; on CPU tensors under Triton's interpreter).

- :mod:`~zeropp.quant.triton.kernels`: the four ``QuantKernels`` functions, and the building blocks
  (block geometry, masked code reads, source sums, the launch) the other kernels share;
- :mod:`~zeropp.quant.triton.hadamard`: the Hadamard rotation, bit for bit the torch butterflies;
- :mod:`~zeropp.quant.triton.feedback`: LoCo's residual update in one pass.
"""
