"""The offload tiers: model states moved to host memory and back on demand (``states``), and
ZeRO-Infinity's disk tier for the optimizer states (``disk``) and the parameters (``disk_params``)."""
