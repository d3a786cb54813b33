"""Groups with delayed global sync for every torch adapter: after each optimizer step, a worker of
a job connected with ``sync="local:T"`` (:class:`~pslink.core.worker.groups.GroupAgent`) hands the
optimizer's parameters to its global sync, which averages them over the groups every T steps.

One mechanism for the DDP hook and the Horovod API: torch's global optimizer step hooks, so no
training loop changes (the torch.distributed backend is one process group: no groups). The parameters are keyed by the
optimizer's place among the optimizers stepped in this process (in the order they first stepped)
and the parameter's place in its param groups: the same on every worker running one program.
T counts optimizer steps (a GAN's two optimizers step twice an iteration).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from pslink.core.worker.groups import GroupAgent
from pslink.errors import ConfigError

_lock = threading.Lock()
_agents: "weakref.WeakSet[GroupAgent]" = weakref.WeakSet()
_optimizers: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_depth: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_handles: list = []


def watch(agent) -> None:
    """Average the parameters of every optimizer this process steps over ``agent``'s groups,
    if ``agent`` is one of a job with groups (else nothing)."""
    if not isinstance(agent, GroupAgent):
        return
    with _lock:
        _agents.add(agent)
        if not _handles:
            # A wrapped optimizer's step (Horovod's DistributedOptimizer) calls its base class's:
            # both are hooked, so the sync waits for the outermost step to end.
            _handles.append(register_optimizer_step_pre_hook(_entered))
            _handles.append(register_optimizer_step_post_hook(_stepped))


def _entered(optimizer, args, kwargs) -> None:
    _depth[optimizer] = _depth.get(optimizer, 0) + 1


def _stepped(optimizer, args, kwargs) -> None:
    depth = _depth.get(optimizer, 1) - 1
    _depth[optimizer] = depth
    if depth > 0:
        return
    live = [agent for agent in list(_agents) if not agent.closed]
    if not live:
        return
    if len(live) > 1:
        jobs = ", ".join(sorted(f"{agent.world_job!r}" for agent in live))
        raise ConfigError(f"optimizer step: this process has workers of several jobs with groups ({jobs}); "
                          "pslink cannot tell which one's weights an optimizer holds: run one per process")
    with _lock:
        index = _optimizers.setdefault(optimizer, len(_optimizers))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    copies = []  # (parameter, its float32 copy): written back after a sync

    def arrays():
        named = {}
        for i, param in enumerate(params):
            data = param.detach()
            if data.device.type == "cpu" and data.is_contiguous() and data.dtype in (torch.float32, torch.float64):
                named[f"torch/o{index}/{i}"] = data.numpy()  # a view: the average lands in the parameter
            else:  # another device or a dtype numpy lacks
                named[f"torch/o{index}/{i}"] = array = data.to("cpu", torch.float32).contiguous().numpy()
                copies.append((param, array))
        return named

    if live[0].end_step(arrays):
        with torch.no_grad():
            for param, array in copies:
                param.copy_(torch.from_numpy(array).to(param.device, param.dtype))
