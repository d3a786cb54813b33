"""A worker for tests/torch/test_torch_trainers.py: a tiny model trained by PyTorch Lightning's
``Trainer`` with ``DDPStrategy(process_group_backend=BACKEND)`` on CPU, 2 processes, started either
way a user would:

    pslink launch -n 2 python trainers_lightning.py BACKEND SCRATCH   # Lightning sees LOCAL_RANK: the
                                                                      # launcher made the processes
    PSLINK_MASTER=tcp://... python trainers_lightning.py pslink SCRATCH   # Lightning starts rank 1

Writes SCRATCH/rank{R}.pt: the weights before and after, the backend torch.distributed reports,
the logged (rank-averaged) loss and what Lightning saw of the world.
"""

from __future__ import annotations

import datetime
import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import pslink.torch  # noqa: F401 - registers the "pslink" backend
from trainer_exit import exit_without_teardown  # (next to this script)

STEPS = 6


class TinyRegressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_index):
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        # sync_dist: Lightning all-reduces the logged value over the ranks (a collective of its own).
        self.log("train_loss", loss, sync_dist=True, on_step=True, prog_bar=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    backend, scratch = sys.argv[1], sys.argv[2]
    launcher = "pslink launch" if "PSLINK_RANK" in os.environ else "lightning"
    L.seed_everything(0, workers=True, verbose=False)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(128, 8, generator=data)
    targets = torch.randn(128, 2, generator=data)
    # Lightning puts a DistributedSampler under this loader (seeded: every run shuffles alike).
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model = TinyRegressor()
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, max_steps=STEPS,
        strategy=DDPStrategy(process_group_backend=backend, timeout=datetime.timedelta(seconds=60)),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True,
    )
    trainer.fit(model, loader)
    rank = trainer.global_rank
    torch.save({
        "backend": dist.get_backend(), "world_size": trainer.world_size, "global_rank": rank,
        "launcher": launcher, "initial": initial,
        "steps": trainer.global_step, "loss": trainer.callback_metrics["train_loss"].clone(),
        "weights": {name: value.detach().clone() for name, value in model.state_dict().items()},
    }, os.path.join(scratch, f"rank{rank}.pt"))
    # Torn down here, while every rank is alive (the exit then skips the interpreter's teardown:
    # trainer_exit.py says why).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()
