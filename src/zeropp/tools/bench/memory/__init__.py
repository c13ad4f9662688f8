"""How much fits: peak memory per rank against the formulas (``memory``), the largest model a memory
limit trains (``largest``), activation checkpoints under a budget, and the rival libraries' ranks."""
