"""Models used by the main job, the benchmarks and the tests."""

from zeropp.app.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
