"""A worker for tests/torch/test_torch_trainers.py: Hugging Face Accelerate's ``Accelerator`` with a
manual training loop on CPU, 2 processes started by ``pslink launch -n 2``.

    pslink launch -n 2 python trainers_accelerate.py BACKEND SCRATCH

On CPU, Accelerate picks the backend by itself (gloo, or mpi where torch has it) and refuses any
other by name. It does honour a process group the script made before it: with BACKEND ``pslink``
this script calls ``dist.init_process_group("pslink")`` first (the one change), with ``gloo`` it
leaves everything to Accelerate (as a stock script does). ``cpu=True`` is needed for both: without
it (or ``ACCELERATE_USE_CPU=1``) Accelerate on a machine with no accelerator does not distribute.

Writes SCRATCH/rank{R}.pt: the weights before and after, the gathered losses, what Accelerate and
torch.distributed report.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import pslink.torch  # noqa: F401 - registers the "pslink" backend
from trainer_exit import exit_without_teardown  # (next to this script)

STEPS = 6


def main() -> None:
    backend, scratch = sys.argv[1], sys.argv[2]
    if backend == "pslink":
        dist.init_process_group("pslink", timeout=datetime.timedelta(seconds=60))
    accelerator = Accelerator(cpu=True)
    set_seed(0)
    data = torch.Generator().manual_seed(1)
    inputs = torch.randn(128, 8, generator=data)
    targets = torch.randn(128, 2, generator=data)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # prepare() shards the loader over the ranks and wraps the model in DDP.
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    model.train()
    for step, (batch_inputs, batch_targets) in enumerate(loader):
        if step == STEPS:
            break
        loss = torch.nn.functional.mse_loss(model(batch_inputs), batch_targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()))  # every rank's loss, in rank order
    mean_loss = accelerator.reduce(losses[-1].sum(), reduction="mean")  # an all-reduce of Accelerate's own
    accelerator.wait_for_everyone()  # a barrier
    state = accelerator.state
    result = {
        "backend": dist.get_backend(), "accelerate_backend": state.backend,
        "distributed_type": str(state.distributed_type), "num_processes": accelerator.num_processes,
        "rank": accelerator.process_index, "steps": len(losses), "losses": torch.stack(losses),
        "mean_loss": mean_loss.clone(), "initial": initial,
        "weights": {name: value.detach().clone()
                    for name, value in accelerator.unwrap_model(model).state_dict().items()},
    }
    torch.save(result, os.path.join(scratch, f"rank{accelerator.process_index}.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
    exit_without_teardown()
