"""Lightning on zeropp: ``torchrun --nproc-per-node 2 examples/lightning_zeropp.py OUT`` (or plain
``python``: Lightning starts the second process itself)."""

import sys

import lightning
import torch
import torch.nn.functional as F
from torch import nn

from zeropp.integrations.lightning import ZeroStrategy  # also registers strategy="zeropp"


class Block(nn.Module):  # the repeated block: zeropp's unit of sharding
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class NextByte(lightning.LightningModule):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.width, self.depth, self.model = width, depth, None

    def configure_model(self) -> None:  # built on the meta device; zeropp initializes it unit by unit
        if self.model is None:
            blocks = [Block(self.width) for _ in range(self.depth)]
            self.model = nn.Sequential(nn.Embedding(256, self.width), *blocks, nn.Linear(self.width, 256))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def main(out: str) -> None:
    lightning.seed_everything(0)
    text = " ".join(f"the {w} fox jumps over the lazy dog {i}." for i, w in enumerate(["quick", "brown", "red"] * 40))
    ids = torch.tensor(list(text.encode()))  # UTF-8 bytes as tokens
    rows = ids[: len(ids) // 33 * 33].view(-1, 33)
    checkpoints = lightning.pytorch.callbacks.ModelCheckpoint(dirpath=out, save_last=True, every_n_train_steps=4)
    trainer = lightning.Trainer(
        accelerator="auto", devices=2, strategy=ZeroStrategy({"stage": 3}), precision="32-true", max_steps=8,
        accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=[checkpoints], logger=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(NextByte(), torch.utils.data.DataLoader(rows, batch_size=4, drop_last=True))
    if trainer.is_global_zero:  # resume: trainer.fit(NextByte(), loader, ckpt_path=f"{out}/last.ckpt")
        print(f"loss {trainer.callback_metrics['loss']:.4f}; wrote {out}/last.ckpt")


if __name__ == "__main__":
    main(sys.argv[1])
