"""How well it trains: convergence over seeds against ZeRO-3, the weight error of quantized
communication, and LoRA on a quantized frozen base."""
