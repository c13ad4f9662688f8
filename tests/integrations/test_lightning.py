"""``ZeroStrategy``: Lightning's Trainer on zeropp, ranks spawned by ``run_ranks`` (Lightning sees
LOCAL_RANK and lets its launcher be; the strategy starts gloo), against plain Lightning in one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from launcher import run_ranks

from examples import docs_include, run_example

pytest.importorskip("lightning")

ROOT = Path(__file__).resolve().parents[2]
START = "forkserver"  # as the Trainer tests: no forked child of a pytest process that started OpenMP
GLOBAL_BATCH = 4
SAMPLES = 24  # 6 global batches: 3 optimizer steps per epoch with accumulation 2
TOLERANCE = 1e-5


def _lightning_classes():
    """The LightningModules, defined where lightning is imported (inside the rank)."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.tanh(self.linear(x))

    def network() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 1))

    class Regression(pl.LightningModule):
        """Repeated blocks (units), a parameter of the LightningModule itself (the root unit), AdamW
        with decay / no-decay groups and a warm-up schedule stepped per optimizer step."""

        def __init__(self) -> None:
            super().__init__()
            self.net = network()
            self.scale = nn.Parameter(torch.ones(1))
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x) * self.scale, y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            named = list(self.named_parameters())
            groups = [
                {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0},
            ]
            optimizer = torch.optim.AdamW(groups, lr=3e-2, eps=1e-4)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class MetaRegression(Regression):
        """The network built in ``configure_model`` (on the meta device under ZeroStrategy)."""

        def __init__(self) -> None:
            pl.LightningModule.__init__(self)
            self.net = None
            self.losses = []
            self.built_on = None

        def configure_model(self) -> None:
            if self.net is None:
                self.net = network()
                self.built_on = self.net[0].weight.device.type

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

    class HFMetaRegression(MetaRegression):
        """A Hugging Face model built in ``configure_model`` inside the LightningModule (Lightning's
        recommended way for large models): on the meta device, initialized by its own _init_weights."""

        def configure_model(self) -> None:
            from transformers import LlamaConfig, LlamaModel

            if self.net is None:
                config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, vocab_size=8)  # fmt: skip
                self.net = nn.ModuleDict(
                    {"into": nn.Linear(8, 16), "llama": LlamaModel(config), "out": nn.Linear(16, 1)}
                )
                self.built_on = self.net["llama"].layers[0].self_attn.q_proj.weight.device.type

        def training_step(self, batch, batch_idx):
            x, y = batch
            hidden = self.net["llama"](inputs_embeds=self.net["into"](x).unsqueeze(1)).last_hidden_state[:, 0]
            loss = F.mse_loss(self.net["out"](hidden), y)
            self.losses.append(loss.item())
            return loss

    class GroupedRegression(Regression):
        """Groups that differ in more than weight decay (a larger rate and other betas for the last
        layer, LoRA+-style) with Adafactor for the rest: stepped whole on owner ranks."""

        def configure_optimizers(self):
            last = set(self.net[-1].parameters())
            rest = [p for p in self.parameters() if p not in last]
            groups = [{"params": rest}, {"params": list(last), "lr": 9e-2, "beta2_decay": -0.5}]
            optimizer = torch.optim.Adafactor(groups, lr=3e-2)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return Regression, MetaRegression, GroupedRegression, HFMetaRegression


def _data(devices: int):
    """This rank's share of every global batch, in order (Lightning's own sampler would shuffle)."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x.sum(1, keepdim=True).sin()
    mine = range(int(os.environ.get("RANK", 0)), SAMPLES, devices)
    return DataLoader(Subset(TensorDataset(x, y), mine), batch_size=GLOBAL_BATCH // devices)


def _trainer(out: str, devices: int, strategy, **overrides):
    import lightning

    settings = dict(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=4, accumulate_grad_batches=2,
        gradient_clip_val=0.5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, default_root_dir=out,
    )  # fmt: skip
    settings.update(overrides)
    return lightning.Trainer(**settings)


def _fit(
    out: str, devices: int, strategy, meta: bool = False, grouped: bool = False, hf: bool = False, **overrides
) -> dict:
    import lightning

    lightning.seed_everything(0, verbose=False)
    regression, meta_regression, grouped_regression, hf_meta_regression = _lightning_classes()
    module = (
        hf_meta_regression if hf else meta_regression if meta else grouped_regression if grouped else regression
    )()
    trainer = _trainer(out, devices, strategy, **overrides)
    trainer.fit(module, _data(devices))
    if hasattr(trainer.strategy, "engine"):
        state = trainer.strategy.full_state_dict()
    else:
        state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    losses = torch.tensor(module.losses)
    if devices > 1:  # the global batch's loss: the ranks' mean
        torch.distributed.all_reduce(losses)
        losses /= devices
    return {"state": state, "losses": losses, "built_on": getattr(module, "built_on", None)}


def _stages(out: str) -> list[dict]:
    from zeropp.integrations.lightning import ZeroStrategy

    return [_fit(f"{out}/stage{stage}", 2, ZeroStrategy({"stage": stage})) for stage in (3, 1, 2)]


def _plain(out: str) -> dict:
    return _fit(out, 1, "auto")


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_two_ranks_equal_plain_lightning_in_one_process(tmp_path):
    """Stages 3, 1, 2 at world 2 (fp32, accumulation 2, clipping, AdamW groups, warm-up) end with the
    weights of plain Lightning in one process on the same global batches."""
    (reference,) = run_ranks(_plain, 1, start=START, out=str(tmp_path / "plain"))
    for rank_runs in run_ranks(_stages, 2, start=START, out=str(tmp_path)):
        for run in rank_runs:
            assert _close(run["state"], reference["state"]) < TOLERANCE
            assert torch.allclose(run["losses"], reference["losses"], atol=TOLERANCE, rtol=0)
    regression = _lightning_classes()[0]
    torch.manual_seed(0)
    assert _close(reference["state"], regression().state_dict()) > 1e-3  # it trained


def _meta(out: str, devices: int) -> list[dict]:
    from zeropp.integrations.lightning import ZeroStrategy

    return [
        _fit(f"{out}/{devices}-{hf}", devices, ZeroStrategy({"stage": 3}), meta=True, hf=hf) for hf in (False, True)
    ]


def test_configure_model_on_meta_is_materialized_by_the_engine(tmp_path):
    """A network built in configure_model lands on the meta device; the engine materializes it under
    seed_everything's seed, the same at world 1 and 2, and the runs agree: a plain network, and a
    Hugging Face model nested in the LightningModule (initialized by its own _init_weights)."""
    (ones,) = run_ranks(_meta, 1, start=START, out=str(tmp_path), devices=1)
    for runs in run_ranks(_meta, 2, start=START, out=str(tmp_path), devices=2):
        for run, one in zip(runs, ones, strict=True):
            assert run["built_on"] == one["built_on"] == "meta"
            assert _close(run["state"], one["state"]) < TOLERANCE
            assert torch.allclose(run["losses"], one["losses"], atol=TOLERANCE, rtol=0)
    assert any(key.endswith("llama.layers.1.mlp.down_proj.weight") for key in ones[1]["state"])


def _resume(out: str) -> tuple[dict, dict, list[str], str]:
    import lightning

    from zeropp.integrations.lightning import ZeroStrategy

    straight = _fit(f"{out}/straight", 2, ZeroStrategy(), max_steps=-1, max_epochs=2)
    regression = _lightning_classes()[0]
    lightning.seed_everything(0, verbose=False)
    first = _trainer(f"{out}/first", 2, "zeropp", max_steps=-1, max_epochs=1)
    first.fit(regression(), _data(2))
    first.save_checkpoint(f"{out}/epoch1.ckpt")
    torch.save(first.strategy.full_state_dict(), f"{out}/epoch1-weights.pt")
    resumed = _trainer(f"{out}/resumed", 2, "zeropp", max_steps=-1, max_epochs=2)
    resumed.fit(regression(), _data(2), ckpt_path=f"{out}/epoch1.ckpt")
    files = sorted(p.name for p in Path(f"{out}/epoch1.ckpt").iterdir())
    return straight["state"], resumed.strategy.full_state_dict(), files, type(resumed.strategy).__name__


def test_save_and_resume_is_bit_identical_and_load_from_checkpoint_reads_it_made_one_file(tmp_path):
    """An epoch, ``trainer.save_checkpoint``, a fresh Trainer (``strategy="zeropp"`` by name) resumed
    with ``ckpt_path=``: the second epoch ends bit-identical to a straight two-epoch run."""
    straight, resumed, files, strategy = run_ranks(_resume, 2, start=START, out=str(tmp_path))[0]
    assert strategy == "ZeroStrategy"
    assert files == ["lightning.ckpt", "zeropp"]
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
    # Lightning's own load_from_checkpoint of what to_lightning_checkpoint writes (in this one process)
    # gives the weights the two ranks held when they saved; a folder that is not one, one line
    from zeropp.integrations.lightning import to_lightning_checkpoint
    from zeropp.integrations.settings import IntegrationError

    whole = to_lightning_checkpoint(tmp_path / "epoch1.ckpt", tmp_path / "epoch1-whole.ckpt")
    loaded = _lightning_classes()[0].load_from_checkpoint(whole).state_dict()
    saved = torch.load(tmp_path / "epoch1-weights.pt")
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
    with pytest.raises(IntegrationError, match="is not a folder ZeroStrategy saved") as error:
        to_lightning_checkpoint(tmp_path, tmp_path / "x.ckpt")
    assert "\n" not in str(error.value)


def test_precision_flags_outside_the_engines_are_refused():
    import lightning

    from zeropp.integrations.lightning import ZeroStrategy
    from zeropp.integrations.settings import IntegrationError

    with pytest.raises(
        IntegrationError, match="precision '16-true': ZeroStrategy takes '32-true', 'bf16-mixed', 'bf16-true'"
    ):
        lightning.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(), precision="16-true", logger=False)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, strategy="zeropp_stage_2", precision="bf16-true", logger=False
    )
    assert trainer.strategy.zero_source == {"stage": 2} and trainer.strategy.precision_plugin.precision == "bf16-true"


def test_the_example_runs_under_torchrun(tmp_path):
    done = run_example("lightning_zeropp.py", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrote" in done.stdout
    assert (tmp_path / "out" / "last.ckpt" / "zeropp").is_dir()


def test_the_docs_include_the_example():
    assert docs_include("trainer-and-lightning.md", "lightning_zeropp.py")


def _grouped(out: str) -> list[dict]:
    from zeropp.integrations.lightning import ZeroStrategy

    return [_fit(f"{out}/stage{stage}", 2, ZeroStrategy({"stage": stage}), grouped=True) for stage in (3, 1)]


def test_adafactor_with_groups_of_their_own_rates_equals_plain_lightning(tmp_path):
    plain = run_ranks(_fit, 1, start=START, out=str(tmp_path / "plain"), devices=1, strategy="auto", grouped=True)[0]
    for zero in run_ranks(_grouped, 2, start=START, out=str(tmp_path))[0]:
        assert _close(zero["state"], plain["state"]) <= TOLERANCE
        assert torch.allclose(zero["losses"], plain["losses"], atol=TOLERANCE)
