"""Optimizers and LR schedules for the GPT: AdamW, or Muon for block matrices + AdamW for the rest.

Lightning's automatic optimization steps exactly one optimizer per training step, while
nanochat steps Muon and AdamW together. ``CombinedOptimizer`` presents several optimizers as
one: one ``step`` (the closure runs once), shared param-group dicts (so LR schedulers and
Lightning's LR monitor see every group), and a ``state`` view routed to the owning optimizer.
Callbacks see one ``on_before_optimizer_step`` per real step.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.optim import Optimizer

from ..arguments import build_options, check_int, check_number, refuse_unknown_fields
from ..model_map import Selection, select_targets

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "linear", "constant")


@refuse_unknown_fields
@dataclass(frozen=True)
class OptimizerSettings:
    """The GPT's optimizer and learning-rate schedule, as ``configs/optimizer/<name>.yaml`` writes them; checked
    here once, then passed whole to :func:`build_optimizer` and :func:`lr_lambda`.

    Example:
        >>> GPTLightningModule({"n_layer": 2}, optimizer=OptimizerSettings(name="muon", warmup_steps=20))
        >>> GPTLightningModule({"n_layer": 2}, optimizer={"lr": 1e-3, "schedule": "constant"})
    """

    name: str = "adamw"  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float = 3e-3  # AdamW's learning rate (with muon: its AdamW part's)
    weight_decay: float = 0.0  # on matrices only (AdamW's 2-D parameters, Muon's matrices)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's
    muon_lr: float = 0.02  # Muon's learning rate
    muon_momentum: float = 0.95  # Muon's momentum
    schedule: str = "cosine"  # cosine | linear | constant, after the warmup
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps
    min_lr_ratio: float = 0.1  # cosine and linear decay to min_lr_ratio · lr
    restart_every_n_steps: int = 0  # > 0: warmup and decay start over every this many steps (a task stream's
    #                                  steps_per_task: a schedule per task); 0: one schedule over the whole fit

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name={self.name!r} is not one of {OPTIMIZERS}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer.schedule={self.schedule!r} is not one of {SCHEDULES}")
        for field in ("lr", "weight_decay", "muon_lr"):
            check_number(f"optimizer.{field}", getattr(self, field), 0.0)
        check_number("optimizer.muon_momentum", self.muon_momentum, 0.0, 1.0)
        check_number("optimizer.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_int("optimizer.warmup_steps", self.warmup_steps, minimum=0)
        check_int("optimizer.restart_every_n_steps", self.restart_every_n_steps, minimum=0)
        if 0 < self.restart_every_n_steps <= self.warmup_steps:
            raise ValueError(f"optimizer.restart_every_n_steps={self.restart_every_n_steps} leaves no step after the "
                             f"warmup (optimizer.warmup_steps={self.warmup_steps}); set it above the warmup, or 0")
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"optimizer.betas={betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.95]")
        for beta in betas:
            check_number("optimizer.betas", beta, 0.0, 1.0, "(each)")
        object.__setattr__(self, "betas", tuple(float(b) for b in betas))

    @classmethod
    def build(cls, value: OptimizerSettings | Mapping | None, owner: str = "GPTLightningModule") -> OptimizerSettings:
        """``value`` as OptimizerSettings: kept, built from a mapping of its fields, or the defaults for None."""
        return cls() if value is None else build_options(cls, value, owner, "optimizer")


class _RoutedState(MutableMapping):
    """``optimizer.state`` of a CombinedOptimizer: each key lives in the optimizer owning it."""

    def __init__(self, optimizers: list[Optimizer]):
        self._optimizers = optimizers

    def _owner(self, param) -> Optimizer:
        for opt in self._optimizers:
            if any(p is param for g in opt.param_groups for p in g["params"]):
                return opt
        raise KeyError("parameter is not managed by this optimizer")

    def __getitem__(self, param):
        return self._owner(param).state[param]

    def __setitem__(self, param, value):
        self._owner(param).state[param] = value

    def __delitem__(self, param):
        del self._owner(param).state[param]

    def __iter__(self):
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self):
        return sum(len(opt.state) for opt in self._optimizers)


class CombinedOptimizer(Optimizer):
    """Several optimizers over disjoint parameters, stepped as one."""

    def __init__(self, optimizers: list[Optimizer]):
        self.optimizers = list(optimizers)
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        super().__init__(params, {})
        # Share the inner group dicts, so schedulers write the learning rates the inner optimizers read.
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.state = _RoutedState(self.optimizers)  # type: ignore[assignment]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict["optimizers"]
        if len(inner) != len(self.optimizers):
            raise ValueError(f"checkpoint has {len(inner)} optimizers, this run has {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, inner):
            opt.load_state_dict(sd)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(type(o).__name__ for o in self.optimizers)})"


def build_optimizer(model: nn.Module, settings: OptimizerSettings | Mapping | None = None) -> Optimizer:
    """``adamw``: one AdamW, no decay on 1-D parameters. ``muon``: ``torch.optim.Muon`` on the
    blocks' 2-D matrices (nanochat's grouping), AdamW on embeddings, head and everything else (``settings``:
    :class:`OptimizerSettings` or a mapping of its fields; None: the defaults)."""
    settings = OptimizerSettings.build(settings, "build_optimizer")
    lr, weight_decay, betas = settings.lr, settings.weight_decay, settings.betas
    if settings.name == "adamw":
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas)
    # a weight a parametrization computes (weight norm, ...) keeps its originals with AdamW, as before
    matrices = [t.param for t in select_targets(model, Selection(include_conv=False))
                if t.param.dim() == 2 and t.through is None]
    matrix_ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in matrix_ids]
    muon = torch.optim.Muon(matrices, lr=settings.muon_lr, momentum=settings.muon_momentum, weight_decay=weight_decay)
    adamw = torch.optim.AdamW(rest, lr=lr, betas=betas, weight_decay=0.0)
    return CombinedOptimizer([muon, adamw])


def lr_lambda(schedule: str, total_steps: int, warmup_steps: int, min_lr_ratio: float,
              restart_every_n_steps: int = 0) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step ``s``: linear warmup, then cosine/linear decay to ``min_lr_ratio``
    at ``total_steps``. With ``restart_every_n_steps > 0`` the warmup and decay run over that many steps and start
    over after each (``total_steps`` is then unused): in a task stream of ``steps_per_task`` steps per task, every
    task gets the same warmup and decay, the per-phase schedule a pipeline gets from one ``Trainer`` per phase.

    Example:
        >>> per_task = lr_lambda("cosine", 0, 10, 0.1, restart_every_n_steps=100)
        >>> per_task(0) == per_task(100) == 0.1 and per_task(10) == per_task(110) == 1.0
        True
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"optimizer.schedule={schedule!r} is not one of {SCHEDULES}")
    period = restart_every_n_steps if restart_every_n_steps > 0 else total_steps

    def factor(step: int) -> float:
        if restart_every_n_steps > 0:
            step %= restart_every_n_steps
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, period - warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * decay

    return factor
