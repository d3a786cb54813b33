"""A worker for tests/torch/test_torch_trainers.py: Hugging Face transformers' ``Trainer`` on a tiny
BERT classifier built from a config (nothing downloaded), on CPU, 2 processes started by
``pslink launch -n 2``.

    pslink launch -n 2 python trainers_transformers.py BACKEND SCRATCH

``Trainer`` sets up its processes through Accelerate, which on CPU refuses every backend but gloo
and mpi by name (``ddp_backend="pslink"`` fails in Accelerate: "Your assigned backend pslink is
not available, please use gloo"), and uses a process group made before it. With BACKEND ``pslink``
this script calls ``dist.init_process_group("pslink")`` before ``TrainingArguments`` (the one
change); with ``gloo`` Accelerate makes the group itself, as for a stock script.

Writes SCRATCH/rank{R}.pt: the weights before and after, the log history (losses averaged over the ranks),
the evaluation (predictions gathered from both ranks) and what torch.distributed reports.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.trainer_utils import set_seed

import pslink.torch  # noqa: F401 - registers the "pslink" backend
from trainer_exit import exit_without_teardown  # (next to this script)

STEPS = 4
VOCABULARY = 64
LENGTH = 12


class RandomSentences(Dataset):
    """Token ids and a label per item, the same in every process (a fixed generator)."""

    def __init__(self, count: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(1, VOCABULARY, (count, LENGTH), generator=generator)
        self.labels = (self.input_ids[:, 0] % 2).long()  # learnable: the first token's parity

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index], "attention_mask": torch.ones(LENGTH, dtype=torch.long),
                "labels": self.labels[index]}


def main() -> None:
    backend, scratch = sys.argv[1], sys.argv[2]
    if backend == "pslink":
        dist.init_process_group("pslink", timeout=datetime.timedelta(seconds=60))
    arguments = TrainingArguments(
        output_dir=os.path.join(scratch, "out"), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none",
        seed=0, disable_tqdm=True, ddp_timeout=60, dataloader_num_workers=0,
    )
    set_seed(0)
    config = BertConfig(vocab_size=VOCABULARY, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=2)
    model = BertForSequenceClassification(config)  # dropout on: its random numbers are per rank, seeded
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    trainer = Trainer(model=model, args=arguments, train_dataset=RandomSentences(64, seed=1),
                      eval_dataset=RandomSentences(16, seed=2))
    trainer.train()
    evaluation = trainer.evaluate()  # every rank's predictions and losses gathered
    rank = arguments.process_index
    torch.save({
        "backend": dist.get_backend(), "world_size": arguments.world_size, "rank": rank,
        "parallel_mode": str(arguments.parallel_mode), "steps": trainer.state.global_step,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "eval_loss": evaluation["eval_loss"], "initial": initial,
        "weights": {name: value.detach().clone() for name, value in model.state_dict().items()},
    }, os.path.join(scratch, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
    exit_without_teardown()
