"""How fast: the step against plain PyTorch, FSDP2 and DeepSpeed (``step``), the stages, zeropp's host
overhead, the host optimizer of ZeRO-Offload, generation, and the collective-sequence check."""
