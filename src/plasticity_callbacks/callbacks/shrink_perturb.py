"""``ShrinkPerturb``: Ash & Adams' warm-starting fix, ``θ ← λ·θ + p·θ_fresh``, once at fit start."""
from __future__ import annotations

import copy
import fnmatch
from typing import Iterator

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..core.distributed import rank_identical_generator, require_full_parameters
from ..core.optimizer_state import reset_optimizer_state
from ..core.targets import validate_patterns
from ..core.arguments import check_number
from ..core.callback_state import check_state


def shrink_perturb_(params: list[torch.Tensor], fresh: list[torch.Tensor], shrink: float, perturb: float) -> None:
    """In place: ``p ← shrink·p + perturb·f`` for every pair (the pure math, no Lightning)."""
    with torch.no_grad():
        for p, f in zip(params, fresh, strict=True):
            p.mul_(shrink).add_(f.to(device=p.device, dtype=p.dtype), alpha=perturb)


def _initializers(module: nn.Module) -> Iterator[nn.Module]:
    """The outermost submodules that define ``init_weights`` (a model's own init, e.g. our GPT),
    and every other module with ``reset_parameters`` (PyTorch layers' default init)."""
    if callable(getattr(module, "init_weights", None)):
        yield module
        return
    if callable(getattr(module, "reset_parameters", None)):
        yield module
    for child in module.children():
        yield from _initializers(child)


def fresh_parameters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A fresh initialization of ``model``'s parameters by the model's own init code, drawn from
    ``seed`` (so every rank gets the same draw), without touching ``model`` or the global RNG."""
    devices = sorted({p.device.index for p in model.parameters() if p.is_cuda})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        fresh = {}
        for name, child in model.named_children():
            if not any(True for _ in child.parameters()):
                continue  # metrics and other parameter-free children
            clone = copy.deepcopy(child)
            for initializer in _initializers(clone):
                (initializer.init_weights if callable(getattr(initializer, "init_weights", None))
                 else initializer.reset_parameters)()
            fresh.update({f"{name}.{k}": v.detach() for k, v in clone.named_parameters()})
        fresh.update({k: v.detach().clone() for k, v in model.named_parameters(recurse=False)})
    return fresh


class ShrinkPerturb(L.Callback):
    """Shrink & Perturb (Ash & Adams, NeurIPS 2020): ``θ ← shrink·θ + perturb·θ_fresh``.

    Acts once, in ``on_fit_start`` (after a checkpoint is restored, before the first step), on
    every selected parameter; ``θ_fresh`` is a fresh initialization of the same model by its
    own init code (``init_weights`` where a module has one, else each layer's
    ``reset_parameters``), drawn from a generator seeded identically on every rank. A resumed
    run does not apply it again. Parameters with no init of their own (bare ``nn.Parameter``s
    of the LightningModule itself) keep their value as ``θ_fresh`` and are only rescaled by
    ``shrink + perturb``.

    Args:
        shrink: λ in [0, 1] (paper default 0.4; the FIRE paper's language runs used 0.5 or 0.8).
        perturb: p >= 0, scale of the fresh initialization (paper default 0.1).
        include / exclude: ``fnmatch`` patterns on parameter names (``model.blocks.*``); default all.
        reset_optimizer: also drop the optimizer state of the changed parameters.
        seed: mixed with the global step into the fresh draw.

    Example:
        >>> trainer = L.Trainer(callbacks=[ShrinkPerturb(shrink=0.4, perturb=0.1)])
        >>> trainer.fit(module, datamodule=next_phase_data)  # shrinks and perturbs, then trains
    """

    def __init__(self, shrink: float = 0.4, perturb: float = 0.1, include: list[str] | None = None,
                 exclude: list[str] | None = None, reset_optimizer: bool = False, seed: int = 0):
        check_number("shrink", shrink, 0.0, 1.0, "(paper: 0.4)")
        check_number("perturb", perturb, 0.0, hint="(paper: 0.1)")
        validate_patterns(include=include, exclude=exclude)
        if not isinstance(reset_optimizer, bool):
            raise ValueError(f"ShrinkPerturb reset_optimizer={reset_optimizer!r} must be true or false")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"ShrinkPerturb seed={seed!r} must be an integer")
        self.shrink, self.perturb, self.seed = float(shrink), float(perturb), seed
        self.include = None if include is None else list(include)
        self.exclude = None if exclude is None else list(exclude)
        self.reset_optimizer = reset_optimizer
        self.applied = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(shrink=self.shrink, perturb=self.perturb, include=self.include,
                                        exclude=self.exclude)

    def selected(self, pl_module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        chosen = []
        for name, param in pl_module.named_parameters():
            if self.include is not None and not any(fnmatch.fnmatchcase(name, p) for p in self.include):
                continue
            if self.exclude is not None and any(fnmatch.fnmatchcase(name, p) for p in self.exclude):
                continue
            chosen.append((name, param))
        if not chosen:
            raise ValueError(f"ShrinkPerturb: no parameters match include={self.include}, exclude={self.exclude}")
        return chosen

    def setup(self, trainer, pl_module, stage: str) -> None:
        require_full_parameters(trainer, "ShrinkPerturb")

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.applied:
            return  # restored from a checkpoint written after the application
        chosen = self.selected(pl_module)
        seed = rank_identical_generator(self.seed, trainer.global_step).initial_seed()
        fresh = fresh_parameters(pl_module, seed)
        norm_before = torch.sqrt(sum(p.detach().float().pow(2).sum() for _, p in chosen))
        shrink_perturb_([p for _, p in chosen], [fresh[n] for n, _ in chosen], self.shrink, self.perturb)
        norm_after = torch.sqrt(sum(p.detach().float().pow(2).sum() for _, p in chosen))
        if self.reset_optimizer:
            reset_optimizer_state(trainer.optimizers, [p for _, p in chosen])
        self.applied = True
        rank_zero_info(f"ShrinkPerturb: θ ← {self.shrink}·θ + {self.perturb}·θ_fresh on {len(chosen)} parameters; "
                       f"norm {float(norm_before):.4g} → {float(norm_after):.4g}")
        if trainer.logger is not None:
            trainer.logger.log_metrics({"shrink_perturb/norm_ratio": float(norm_after / norm_before.clamp_min(1e-12))},
                                       step=trainer.global_step)

    def state_dict(self) -> dict:
        return {"applied": self.applied}

    def load_state_dict(self, state_dict: dict) -> None:
        check_state(self, state_dict, {"applied": bool})
        self.applied = state_dict["applied"]
