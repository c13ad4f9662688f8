"""The Hugging Face Trainer on zeropp: ``torchrun --nproc-per-node 2 examples/hf_trainer.py OUT``."""

import sys

import torch
import transformers

from zeropp.integrations.transformers import ZeroTrainer

ZERO = {  # a DeepSpeed config as a dict (or its JSON path); "auto" takes the TrainingArguments' values
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3},
}


def main(out: str) -> None:
    config = transformers.LlamaConfig(  # tiny, from a config: no downloads
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)
    text = " ".join(f"the {w} fox jumps over the lazy dog {i}." for i, w in enumerate(["quick", "brown", "red"] * 40))
    ids = torch.tensor(list(text.encode()))  # UTF-8 bytes as tokens
    rows = ids[: len(ids) // 32 * 32].view(-1, 32)
    dataset = [{"input_ids": row, "labels": row} for row in rows]
    args = transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=3e-3, warmup_steps=2, weight_decay=0.1, max_grad_norm=1.0, logging_steps=2,
        save_steps=3, report_to="none", use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
    )
    trainer = ZeroTrainer(model=model, args=args, train_dataset=dataset, zero_config=ZERO)
    trainer.train()
    trainer.save_model(f"{out}/final")  # AutoModelForCausalLM.from_pretrained(f"{out}/final")
    if trainer.is_world_process_zero():
        print(f"last loss {trainer.state.log_history[-2]['loss']:.4f}; wrote {out}/final")


if __name__ == "__main__":
    main(sys.argv[1])
