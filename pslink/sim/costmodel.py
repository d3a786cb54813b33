"""What one model aggregation task costs an Aggregator: CPU seconds per round, by bytes and workers.

One round of a task of ``b`` bytes with ``W`` workers makes the Aggregator receive ``W`` pushes
(a copy from the socket into a pooled buffer each), add ``W - 1`` of them into the first, run the
optimizer once (``optimizer`` mode) and send ``W`` replies (a copy into the socket each)::

    cost = W * per_message + b * (W * per_byte_worker[optimizer] + per_byte_round[optimizer])

``per_byte_worker`` is what every worker's push and reply add (receive, add, send), and
``per_byte_round`` what a round costs once whatever the number of workers (the optimizer's step;
for ``sum`` nothing: the first push becomes the sum). Every term is >= 0 (the fit is constrained). Both are fitted per
optimizer (``sum`` for none): the modes hold different numbers of buffers per round, and past the
Aggregator's pool of four buffers a round pays for fresh ones, so their slopes differ. The figures come
from ``pslink simulate calibrate`` (:mod:`pslink.sim.calibrate`), which drives the real
Aggregator core; the package ships one such file (``pslink/sim/data/costmodel.json``) with the
machine it was measured on. No I/O here but :func:`load_cost_model` and :func:`save_cost_model`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from pslink.errors import ConfigError

FORMAT = 1
OPTIMIZERS = ("sum", "sgd", "adam")


@dataclasses.dataclass(frozen=True)
class CostModel:
    per_message: float  # CPU seconds per push and its reply, whatever their size
    per_byte_worker: dict[str, float]  # CPU seconds per byte, per worker, per round, by optimizer
    per_byte_round: dict[str, float]  # CPU seconds per byte, once per round, by optimizer ("sum" for none)
    machine: dict[str, Any] = dataclasses.field(default_factory=dict)
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)  # raw samples, for the record

    def __post_init__(self):
        if not (_number(self.per_message) and self.per_message >= 0):
            raise ConfigError(f"cost model: per_message must be a finite number >= 0, got {self.per_message!r}")
        for table in ("per_byte_worker", "per_byte_round"):
            values = getattr(self, table)
            missing = [o for o in OPTIMIZERS if o not in values]
            if missing:
                raise ConfigError(f"cost model: {table} lacks {', '.join(missing)}")
            bad = {o: v for o, v in values.items() if not _number(v)}
            if bad:
                raise ConfigError(f"cost model: {table} must hold finite numbers, got {bad}")
        for table in ("per_byte_worker", "per_byte_round"):
            negative = {o: v for o, v in getattr(self, table).items() if v < 0}
            if negative:
                # A negative term makes some round (one worker, a large tensor) cost less than
                # nothing; pslink simulate calibrate fits every term >= 0.
                raise ConfigError(f"cost model: {table} must be >= 0, got {negative} (re-run pslink simulate calibrate)")

    def task_cost(self, nbytes: int, workers: int, optimizer: str) -> float:
        """e_t: CPU seconds one round of a task costs."""
        if optimizer not in self.per_byte_round:
            raise ConfigError(f"cost model has no optimizer {optimizer!r}; it has {', '.join(self.per_byte_round)}")
        return round_seconds(self.per_message, self.per_byte_worker[optimizer], self.per_byte_round[optimizer],
                             nbytes, workers)

    def to_dict(self) -> dict:
        return {"format": FORMAT, "per_message": self.per_message, "per_byte_worker": dict(self.per_byte_worker),
                "per_byte_round": dict(self.per_byte_round), "machine": self.machine, "measured": self.measured}

    @classmethod
    def from_dict(cls, data: Any, source: str = "cost model") -> "CostModel":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ConfigError(f"{source}: format {data.get('format')!r} is not {FORMAT} (re-run pslink simulate calibrate)")
        try:
            tables = {name: data[name] for name in ("per_byte_worker", "per_byte_round")}
            for name, table in tables.items():
                if not isinstance(table, dict):
                    raise ConfigError(f"{source}: {name} must be an object (optimizer -> seconds per byte)")
            return cls(per_message=data["per_message"], per_byte_worker=dict(tables["per_byte_worker"]),
                       per_byte_round=dict(tables["per_byte_round"]), machine=data.get("machine") or {},
                       measured=data.get("measured") or {})
        except KeyError as exc:
            raise ConfigError(f"{source}: missing field {exc.args[0]!r}") from None
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc.message.removeprefix('cost model: ')}") from None


def round_seconds(per_message: float, per_byte_worker: float, per_byte_round: float, nbytes: int,
                  workers: int) -> float:
    """The model's formula: ``W * per_message + bytes * (W * per_byte_worker + per_byte_round)``."""
    return workers * per_message + nbytes * (workers * per_byte_worker + per_byte_round)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def default_cost_model_path() -> Path:
    return Path(str(resources.files("pslink.sim") / "data" / "costmodel.json"))


def load_cost_model(path: str | Path | None = None) -> CostModel:
    """The cost model in ``path`` (JSON), or the packaged default."""
    path = Path(path) if path is not None else default_cost_model_path()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"cost model file {str(path)!r} not found (make one with pslink simulate calibrate)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read cost model file {str(path)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"cost model file {str(path)!r} is not valid JSON: {exc}") from None
    return CostModel.from_dict(data, source=f"cost model file {str(path)!r}")


def save_cost_model(model: CostModel, path: str | Path) -> None:
    Path(path).write_text(json.dumps(model.to_dict(), indent=2) + "\n")
