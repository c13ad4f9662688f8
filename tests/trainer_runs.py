"""What the Hugging Face Trainer tests share (ZeroTrainer, PEFT, TRL): a tiny Llama, its rows, the
TrainingArguments of a short exact run, and the largest difference of two state dicts."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 4
STEPS = 4
TOLERANCE = 1e-5
PROBE = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]])


def rows(n: int = 48, length: int = 16, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def tiny_llama():
    from models import hf_model

    torch.manual_seed(0)
    return hf_model("hf-llama")


def training_settings(out: str, world: int, **overrides) -> dict:
    """TrainingArguments' keywords (also SFTConfig's) for a short exact run of GLOBAL_BATCH rows per step."""
    settings = dict(
        output_dir=out, per_device_train_batch_size=GLOBAL_BATCH // world, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=3e-3, lr_scheduler_type="linear", warmup_steps=2, weight_decay=0.1,
        optim="adamw_torch", adam_epsilon=1e-4, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, dataloader_drop_last=True, train_sampling_strategy="sequential",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    return {**settings, **overrides}


def training_args(out: str, world: int, **overrides):
    import transformers

    return transformers.TrainingArguments(**training_settings(out, world, **overrides))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
