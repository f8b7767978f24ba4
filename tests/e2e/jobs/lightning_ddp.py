"""PyTorch Lightning's own launcher: a Trainer with accelerator="cpu", devices=2, strategy="ddp" (gloo), so that
Lightning's _SubprocessScriptLauncher runs this script again for rank 1. It trains a tiny linear model on random
tensors (nothing downloaded) until stopped; each rank writes `<MARKS>/rank-<r>` with its pid once it trains."""

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset


class Tiny(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_index):
        if batch_index == 1:  # a step done: both ranks are in the training loop
            mark = Path(os.environ["MARKS"]) / f"rank-{self.global_rank}"
            if not mark.exists():
                mark.write_text(str(os.getpid()))
        features, target = batch
        return torch.nn.functional.mse_loss(self.layer(features), target)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=-1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=os.environ["MARKS"])
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    print(f"rank {trainer.global_rank}: fit returned, received_sigterm={trainer.received_sigterm}", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
