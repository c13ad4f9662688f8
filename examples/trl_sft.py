"""TRL's SFTTrainer on zeropp: ``torchrun --nproc-per-node 2 examples/trl_sft.py OUT``.

Any ``transformers.Trainer`` subclass composes the same way: ZeroTrainer first (the engine, backward,
optimizer, checkpoints), the subclass after it (its datasets, collator, loss, metrics)."""

import sys

import datasets
import torch
import transformers
import trl
from tokenizers import Tokenizer, models, pre_tokenizers

from zeropp.integrations.transformers import ZeroTrainer


class ZeroSFTTrainer(ZeroTrainer, trl.SFTTrainer):
    """SFTTrainer through a zeropp engine: takes SFTTrainer's arguments plus ``zero_config=``."""


def main(out: str) -> None:
    words = "the quick brown fox jumps over the lazy dog".split()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + ["<pad>", "<eos>"]))}  # a word-level tokenizer, no download
    words_only = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words_only.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words_only, pad_token="<pad>", eos_token="<eos>")
    config = transformers.LlamaConfig(  # tiny, from a config
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=vocab["<pad>"], eos_token_id=vocab["<eos>"],
    )
    model = transformers.LlamaForCausalLM(config)
    texts = [" ".join(words[i % 3 :] + words[: i % 3]) for i in range(64)]
    args = trl.SFTConfig(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-2,
        warmup_steps=2, logging_steps=2, save_strategy="no", report_to="none", use_cpu=not torch.cuda.is_available(),
    )
    trainer = ZeroSFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tokenizer,
        zero_config={"stage": 3},
    )
    trainer.train()
    trainer.save_model(f"{out}/final")
    if trainer.is_world_process_zero():
        print(f"last loss {trainer.state.log_history[-2]['loss']:.4f}; wrote {out}/final")


if __name__ == "__main__":
    main(sys.argv[1])
