"""One worker of test_elastic_torch.py, run by ``pslink launch --min-np A --max-np B``.

    python elastic_worker.py OUT_DIR

Trains a linear regression (a fixed, seeded problem) with SGD and momentum under
``pslink.torch.elastic.run`` until a file OUT_DIR/stop exists; the workers agree on stopping
through an allreduce, so they all stop at the same commit. Every process appends JSON lines to
OUT_DIR/events-<pid>.jsonl: ``reset`` (after every sync: world, generation, counters and digests
of the model and of the optimizer state), ``commit`` and ``done``. The test reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time

import torch

import pslink.torch as hvd
from pslink.torch.horovod import current_session

OUT = sys.argv[1]
if os.environ.get("PSLINK_LOG_LEVEL"):  # what the worker's Agent and pslink.torch.elastic say
    logging.basicConfig(level=os.environ["PSLINK_LOG_LEVEL"], stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s")
FEATURES, ROWS, BATCH = 8, 512, 16
COMMIT_EVERY = 5

problem = torch.Generator().manual_seed(0)
X = torch.randn(ROWS, FEATURES, generator=problem)
W_TRUE = torch.randn(FEATURES, 1, generator=problem)
Y = X @ W_TRUE + 0.01 * torch.randn(ROWS, 1, generator=problem)

events = open(os.path.join(OUT, f"events-{os.getpid()}.jsonl"), "a", buffering=1)


def log(kind: str, **fields) -> None:
    fields.update(event=kind, pid=os.getpid(), time=time.time())
    events.write(json.dumps(fields) + "\n")


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


hvd.init()
torch.manual_seed(1000 + int(os.environ["PSLINK_RANK"]))  # every process starts from other weights
model = torch.nn.Linear(FEATURES, 1)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
                                     named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)


def describe(kind: str, **extra) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    buffers = [optimizer.state[p]["momentum_buffer"] for p in params if "momentum_buffer" in optimizer.state[p]]
    log(kind, rank=hvd.rank(), size=hvd.size(), service_rank=int(os.environ["PSLINK_RANK"]),
        generation=current_session().generation, epoch=state.epoch, batch=state.batch,
        commits=state.commits, model=digest(model.state_dict().values()), optimizer=digest(buffers),
        momentum_buffers=len(buffers), lr=optimizer.param_groups[0]["lr"], **extra)


state.register_reset_callbacks([lambda: describe("reset")])


def full_loss() -> float:
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(X), Y))


@hvd.elastic.run
def train(state) -> float:
    while True:
        # Each worker takes its own rows of the step's window: the shards follow the world's size.
        start = ((state.batch * hvd.size() + hvd.rank()) * BATCH) % ROWS
        rows = torch.arange(start, start + BATCH) % ROWS
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(X[rows]), Y[rows])
        loss.backward()
        optimizer.step()
        state.batch += 1
        if state.batch % COMMIT_EVERY == 0:
            if state.batch % 100 == 0:
                state.epoch += 1
            stop = hvd.allreduce(torch.tensor([float(os.path.exists(os.path.join(OUT, "stop")))]), op=hvd.Sum,
                                 name="stop")
            state.commit()
            log("commit", size=hvd.size(), rank=hvd.rank(), batch=state.batch, loss=full_loss())
            if stop.item() > 0:
                return full_loss()


loss = train(state)
session = current_session()
# Keys of earlier generations left on the service (rank 0 of each world deletes them at its reset)
stale = [s["key"] for s in session.agent.job_keys() if isinstance(s["key"], str)
         and re.search(r"elastic\.g\d+/|\.noname\.g\d+\.", s["key"])
         and f"elastic.g{session.generation}/" not in s["key"] and f".noname.g{session.generation}." not in s["key"]]
describe("done", stale_keys=stale, loss=loss, weights=[float(v) for v in model.weight.detach().reshape(-1)] + [float(model.bias.detach())])
