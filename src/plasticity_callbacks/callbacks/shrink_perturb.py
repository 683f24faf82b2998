"""``ShrinkPerturb``: Ash & Adams' warm-starting fix, ``θ ← λ·θ + p·θ_fresh``, on a schedule."""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..ops import factorization
from ..arguments import check_number
from ..distributed.strategy import is_dtensor, rank_identical_generator, require_full_parameters
from ..model_map import Selection, fresh_parameters
from ..model_map.holding import is_factorization, is_frozen, is_frozen_parameter, parametrization, weight_in_buffer
from ..ops.optimizer_state import reset_optimizer_state
from .schedule import Schedule
from ..distributed.sharding import local_part
from ..functional.shrink import shrink_perturb_
from .base import PlasticityCallback


class ShrinkPerturb(PlasticityCallback):
    """Shrink & Perturb (Ash & Adams, NeurIPS 2020): ``θ ← shrink·θ + perturb·θ_fresh``.

    When: ``schedule`` (:class:`~callbacks.schedule.Schedule`; default: once at fit
    start, in ``on_train_start``, after a checkpoint is restored and before the first step). Epoch
    triggers act in ``on_train_epoch_start``, step triggers and task boundaries in
    ``on_train_batch_start``, plateaus in ``on_validation_end``; each trigger acts once, also across
    a resume. What changes: every selected trainable parameter (a frozen one, ``requires_grad=False``,
    only when an ``include`` pattern names it); ``θ_fresh`` is a fresh initialization of the
    same model by its own init code (:func:`plasticity_callbacks.model_map.fresh_parameters`:
    Hugging Face ``_init_weights``, ``init_weights``, a model built by ``self.apply(self._init_weights)``
    rebuilt from its config, ``_reset_parameters`` (MHA, ``nn.Transformer``), each layer's
    ``reset_parameters``, PEFT's LoRA init: ``lora_B`` fresh is zeros), drawn from a generator seeded
    from ``seed`` and the global step, identically on every rank. A selected parameter that no init
    reaches (a bare ``nn.Parameter`` of the LightningModule) and a matrix whose fresh draw equals its
    current value are named: the first is an error (exclude it or give it init code), the second a
    warning. A weight factorized by ``AdaptiveSVDSwitch(minor_training="factorize")`` is treated as its
    effective weight ``W_p + BA`` (its frozen ``W_p`` absorbs the change; ``B, A`` are kept); one
    computed by a parametrization (weight norm, spectral norm) through its ``original`` parameters,
    drawn fresh as the parametrization makes them from a fresh weight; ``orthogonal``, which keeps the
    weight in a buffer, is refused by name (exclude it).
    Logs ``shrink_perturb/norm_ratio`` (‖θ‖ after / before). Under FSDP2 every rank draws the whole
    fresh model, the values one process draws for the same seed, and treats the rows it holds
    (peak extra memory: one full copy of the largest unit its init draws at once).

    Args:
        shrink: λ in [0, 1] (paper default 0.4; the FIRE paper's language runs used 0.5 or 0.8).
        perturb: p >= 0, scale of the fresh initialization (paper default 0.1).
        schedule: when to act (a Schedule or a mapping of its fields); None: ``Schedule(at_fit_start=True)``.
        selection: which parameters, by name: a :class:`~model_map.Selection`
            (or a mapping of its fields) whose ``include``/``exclude`` patterns are matched against
            parameter names (``model.blocks.*``); None: every parameter, biases, norms and the head too.
        reset_optimizer: also drop the optimizer state of the changed parameters.
        seed: mixed with the global step into the fresh draw.

    Example:
        >>> sp = ShrinkPerturb(shrink=0.4, perturb=0.1, schedule=Schedule(every_n_epochs=10))
        >>> trainer = L.Trainer(callbacks=[sp], max_epochs=100)
        >>> trainer.fit(module, datamodule=data)  # shrinks and perturbs at epochs 10, 20, ...
    """

    summary_metrics = ("shrink_perturb/norm_ratio",)
    extra_state_types = {"applications": int}

    def __init__(self, shrink: float = 0.4, perturb: float = 0.1, schedule: Schedule | Mapping | None = None,
                 selection: Selection | Mapping | None = None, reset_optimizer: bool = False, seed: int = 0):
        check_number("shrink", shrink, 0.0, 1.0, "(paper: 0.4)")
        check_number("perturb", perturb, 0.0, hint="(paper: 0.1)")
        if not isinstance(reset_optimizer, bool):
            raise ValueError(f"{self.owner} reset_optimizer={reset_optimizer!r} must be true or false")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{self.owner} seed={seed!r} must be an integer")
        super().__init__(schedule, _name_patterns(Selection.build(selection, self.owner), self.owner))
        self.shrink, self.perturb, self.seed = float(shrink), float(perturb), seed
        self.reset_optimizer = reset_optimizer
        self.applications = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(shrink=self.shrink, perturb=self.perturb, include=self.selection.include,
                                        exclude=self.selection.exclude, schedule=self.schedule.describe())

    def selected(self, pl_module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` pairs to treat: the selection's, minus those the user froze unless an ``include``
        pattern names them. A factorized weight (``W_p + BA``) appears once, under its plain name
        (``layer.weight``) with ``W_p`` as its parameter; its ``B, A`` are part of it. A weight computed by the
        user's parametrization (weight norm, ...) is treated through its ``original`` parameters."""
        chosen = []
        for name, param in pl_module.named_parameters():
            frozen = is_frozen_parameter(param)
            if ".parametrizations." in name:
                path, rest = name.split(".parametrizations.", 1)
                module, attr = pl_module.get_submodule(path), rest.split(".", 1)[0]
                if is_factorization(module, attr):
                    if not name.endswith(".original"):
                        continue  # B, A: inside the effective weight
                    name, frozen = f"{path}.{attr}", is_frozen(module, attr)
                elif weight_in_buffer(module, attr) and self.selection.matches(name) and not frozen:
                    raise ValueError(f"{self.owner} cannot treat {path}.{attr}: its parametrization "
                                     f"({parametrization(module, attr)}) keeps the weight in a buffer, not in {name}; "
                                     f"exclude it: {self.owner}(selection={ {'exclude': [name]} })")
            if frozen and self.selection.include is None:
                continue  # the user froze it; an include pattern naming it treats it
            if self.selection.matches(name):
                chosen.append((name, param))
        if not chosen:
            raise ValueError(f"{self.owner}: no parameters match include={self.selection.include}, "
                             f"exclude={self.selection.exclude} (frozen ones count only where include names them)")
        return chosen

    def check_strategy(self, trainer) -> None:
        require_full_parameters(trainer, self.owner, fsdp2=True)  # FSDP2: each rank's rows of the fresh draw

    def check_targets(self, trainer, pl_module) -> None:
        self.selected(pl_module)  # an empty selection fails before any training

    def act(self, trainer, pl_module, reason: str) -> dict[str, float]:
        chosen = self.selected(pl_module)
        seed = rank_identical_generator(self.seed, trainer.global_step).initial_seed()
        fresh = _checked_fresh(pl_module, chosen, seed, self.owner)
        factorized = {n: p for n, p in chosen if _factorized(pl_module, n)}
        plain = [(n, p) for n, p in chosen if n not in factorized]
        norm_before = _norm(pl_module, chosen)
        # FSDP2: each rank treats its rows of every parameter with its rows of the whole fresh draw
        shards = [local_part(p) for _, p in plain]
        shrink_perturb_([local for local, _ in shards], [fresh[n][rows] for (n, _), (_, rows) in zip(plain, shards)],
                        self.shrink, self.perturb)
        for name, frozen in factorized.items():  # on the effective weight: W_p ← λ(W_p + BA) + p·fresh − BA
            module, attr = _owner(pl_module, name)
            with torch.no_grad():
                parts = factorization.components(module, attr)
                effective = getattr(module, attr).detach()
                new = self.shrink * effective + self.perturb * fresh[name].to(effective)
                frozen.copy_(new - parts.delta(frozen))
        norm_after = _norm(pl_module, chosen)
        if self.reset_optimizer:
            trainable = [p for n, p in plain] + [q for n in factorized
                                                 for q in factorization.components(*_owner(pl_module, n)).parameters()]
            reset_optimizer_state(trainer.optimizers, trainable)
        self.applications += 1
        rank_zero_info(f"{self.owner} ({reason}): θ ← {self.shrink}·θ + {self.perturb}·θ_fresh on "
                       f"{len(chosen)} parameters at step {trainer.global_step}; norm {float(norm_before):.4g} → "
                       f"{float(norm_after):.4g}")
        return {"shrink_perturb/norm_ratio": float(norm_after / norm_before.clamp_min(1e-12))}

    def extra_state(self) -> dict:
        return {"applications": self.applications}

    def load_extra_state(self, state: dict) -> None:
        self.applications = int(state["applications"])


def _name_patterns(selection: Selection, owner: str) -> Selection:
    """Shrink & Perturb treats every parameter (biases, norms, the head): only name patterns can narrow it."""
    if (selection.scope, selection.include_conv, selection.include_head) != ("all", True, False):
        raise ValueError(f"{owner} selection={selection}: this method selects parameters by name only; set "
                         "include/exclude patterns (scope, include_conv and include_head do not apply)")
    return selection


def _checked_fresh(pl_module: nn.Module, chosen: list[tuple[str, nn.Parameter]], seed: int, owner: str) -> dict:
    """The fresh draw of every chosen parameter, or a clear error: never a silent copy of the current value."""
    fresh = fresh_parameters(pl_module, seed)
    missing = [name for name, _ in chosen if name not in fresh]
    if missing:
        raise RuntimeError(f"{owner}: no init code draws a fresh value for {missing}; give their module "
                           "reset_parameters() (or the model init_weights() or _init_weights(module)), or exclude "
                           f"them: {owner}(selection={ {'exclude': missing} })")
    unchanged = [name for name, p in chosen  # FSDP2: this rank's rows
                 if p.dim() >= 2 and torch.equal(fresh[name][local_part(p)[1]].to(p.device),
                                                 local_part(_value(pl_module, name, p))[0])]
    if unchanged:  # an init that copies, or the very seed the model was built with: either way a mere rescale
        rank_zero_warn(f"{owner}: the fresh draw of {unchanged} equals the current weights, so shrink & perturb "
                       "only rescales them; pass another seed=, or fix their init code if it copies instead of drawing")
    return fresh


def _owner(pl_module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, attr = name.rsplit(".", 1) if "." in name else ("", name)
    return pl_module.get_submodule(path), attr


def _factorized(pl_module: nn.Module, name: str) -> bool:
    module, attr = _owner(pl_module, name)
    return factorization.is_factorized(module, attr)


def _value(pl_module: nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """The parameter's value as the model uses it: the effective ``W_p + BA`` for a factorized weight."""
    if _factorized(pl_module, name):
        module, attr = _owner(pl_module, name)
        return getattr(module, attr).detach()
    return param.detach()


def _norm(pl_module: nn.Module, chosen) -> torch.Tensor:
    """‖θ‖ over the chosen parameters; FSDP2: each DTensor's rows summed over the ranks (one all-reduce)."""
    with torch.no_grad():
        values = [_value(pl_module, n, p) for n, p in chosen]
        sharded = [v for v in values if is_dtensor(v)]
        whole = sum((v.float().pow(2).sum() for v in values if not is_dtensor(v)), torch.zeros(()))
        if not sharded:
            return torch.sqrt(whole)
        rows = sum(v.to_local().float().pow(2).sum() for v in sharded)
        dist.all_reduce(rows, group=sharded[0].device_mesh.get_group())
        return torch.sqrt(whole.to(rows.device) + rows)
