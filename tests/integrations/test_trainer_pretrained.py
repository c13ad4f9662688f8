"""``ZeroTrainer(meta model, pretrained=DIR)``: the weights of a ``save_pretrained`` folder read straight
into the shards. It trains to the weights of a model loaded whole from the folder, and no rank's host
memory ever holds the whole model while the trainer and its engine are set up."""

from __future__ import annotations

import ctypes

import pytest
import torch
from launcher import run_ranks
from trainer_runs import TOLERANCE, max_difference, rows, tiny_llama, training_args

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

START = "forkserver"  # see test_transformers.py


def _on_meta(config):
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _meta_and_loaded(out: str, folder: str) -> tuple[float, float]:
    """(largest difference of the two trained models, of the meta one's start and the folder's)."""
    import transformers

    import zeropp
    from zeropp.integrations.transformers import ZeroTrainer

    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    saved = {k: v.clone() for k, v in loaded.state_dict().items()}
    meta = ZeroTrainer(
        _on_meta(loaded.config), training_args(f"{out}/meta", 2), train_dataset=rows(), pretrained=folder,
        zero_config=zeropp.ZeroConfig(stage=3),
    )  # fmt: skip
    meta.create_optimizer()  # the engine, built and loaded before training
    start = max_difference(meta.engine.full_state_dict(), saved)
    meta.train()
    whole = ZeroTrainer(
        loaded, training_args(f"{out}/whole", 2), train_dataset=rows(), zero_config=zeropp.ZeroConfig(stage=3)
    )
    whole.train()
    return max_difference(meta.engine.full_state_dict(), whole.engine.full_state_dict()), start


def test_a_meta_model_with_pretrained_trains_like_the_loaded_model(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "pretrained")
    for trained, start in run_ranks(
        _meta_and_loaded, 2, start=START, out=str(tmp_path), folder=str(tmp_path / "pretrained")
    ):
        assert start == 0.0
        assert trained < TOLERANCE


def big_llama(layers: int, width: int):
    """A Llama whose decoder layers hold 16 * width**2 fp32 elements each, almost all of the model."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _setup_peak(out: str, folder: str, meta: bool) -> int:
    """Host memory high-water mark (bytes above the start) while a ZeroTrainer and its engine are
    built on the folder's model: on the meta device with ``pretrained=``, or loaded whole."""
    import transformers

    import zeropp
    from zeropp.costs.memory import PeakMeter
    from zeropp.integrations.transformers import ZeroTrainer

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # freed blocks go back (see test_materialize.py)
    config = transformers.AutoConfig.from_pretrained(folder)

    def build(model, **kwargs) -> ZeroTrainer:
        args = training_args(out, 1, per_device_train_batch_size=1)
        trainer = ZeroTrainer(model, args, train_dataset=rows(), zero_config=zeropp.ZeroConfig(stage=3), **kwargs)
        trainer.create_optimizer()
        return trainer

    build(big_llama(1, 8))  # what the first trainer loads lazily (libraries, caches) is not the model's memory
    meter = PeakMeter(torch.device("cpu"))
    if meta:
        build(_on_meta(config), pretrained=folder)
    else:
        build(transformers.AutoModelForCausalLM.from_pretrained(folder))
    return meter.peak()


def test_no_rank_holds_the_whole_model_while_setting_up(tmp_path):
    """8 layers of 16 MiB on 4 ranks (2 nodes x 2) at stage 3. A rank ends with its quarter of the
    model as master shards, has touched its quarter of the mapped file (the slices it read, resident
    until the file is closed), and materializes one layer's flat buffer at a time: the bound allows
    those and two layers at once, 3/4 of the model. A rank loading the model whole crosses it."""
    layers, width = 8, 512
    big_llama(layers, width).save_pretrained(tmp_path / "big")
    model_bytes = layers * 16 * width * width * 4
    folder = str(tmp_path / "big")
    peaks = run_ranks(_setup_peak, 4, nodes=2, start=START, out=str(tmp_path), folder=folder, meta=True)
    bound = 2 * model_bytes / 4 + 2 * model_bytes / layers
    assert max(peaks) <= bound < model_bytes, (peaks, bound)
    eager = run_ranks(_setup_peak, 1, start=START, out=str(tmp_path), folder=folder, meta=False)[0]
    assert eager > model_bytes > bound, (eager, bound)
