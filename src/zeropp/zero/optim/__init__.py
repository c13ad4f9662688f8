"""The optimizer on the ranks' shards: which masters each step updates and when (``stepping``), and
Adam with its moments stored in bf16 (``low_precision_adam``)."""
