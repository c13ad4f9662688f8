"""The CUDA path in one command (``check``: its measuring stages, ranks sharing a device, the report),
and the Triton quantization kernels against a device copy (``kernels``)."""
