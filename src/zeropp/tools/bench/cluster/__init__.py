"""zeropp against DDP, FSDP2 and DeepSpeed on an emulated cluster (``compare``), and each step's
distance from what the link and the compute allow (``bound``)."""
