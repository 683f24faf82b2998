"""``DASHShrink``: shrink neurons whose weights point against the descent direction (DASH).

The math lives in :mod:`plasticity_callbacks.functional.shrink`; this file decides when and on what.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from ..core.distributed import all_reduce_mean, require_full_parameters
from ..core.optimizer_state import owning_optimizer
from ..functional.shrink import apply_shrink_, dash_shrink_factors, penalty_shrink_factors
from ..core.model_map import Selection, WeightView, refuse_factorized, require_targets, select_targets
from ..core.arguments import check_int, check_number
from ..core.callback_state import check_state
from ..core.schedule import Schedule, ScheduleState

RULES = ("periodic", "dash")
GRADIENT_MODES = ("eval", "train")  # the mode of the paper rule's gradient pass


@dataclass(frozen=True)
class _Layer:
    name: str  # module name, e.g. "net.0" (metric names use it)
    view: WeightView  # the weight in (out, in) orientation: one factor per output neuron (row)
    bias: nn.Parameter | None  # shrunk with one scalar factor when shrink_bias=True

    @property
    def weight(self) -> nn.Parameter:
        return self.view.param


class DASHShrink(L.Callback):
    """Direction-aware shrinking: a periodic rule on the current gradient, or the DASH paper's rule.

    When: ``schedule`` (:class:`~plasticity_callbacks.core.schedule.Schedule`). Every trigger acts once,
    also across a resume; several on the same optimizer step act once.

    ``rule="periodic"`` takes step triggers only (``steps``, ``every_n_steps``, task boundaries;
    default ``Schedule(every_n_steps=2000)``) and acts in ``on_before_optimizer_step`` of the step
    taken when ``trainer.global_step`` reaches one (counted in optimizer steps, so once per real
    step under gradient accumulation). It multiplies every row (conv: every (out, in) kernel
    slice) of a selected weight by ``clamp(1 − rate·clamp(cos(W, grad) − alpha, 0), floor, 1)``
    using the current gradient. At that hook the gradients are already all-reduced under DDP
    and, with ``precision="16-mixed"``, already unscaled by Lightning's AMP plugin (it calls
    ``scaler.unscale_`` before the hook; an optimizer that unscales inside its own ``step`` would
    leave them scaled, which a cosine does not notice). A scheduled step whose gradients (any
    parameter's) are not all finite is skipped, not postponed: the AMP scaler would skip it too.

    ``rule="dash"`` (Shin et al., NeurIPS 2024) takes any trigger (default
    ``Schedule(at_fit_start=True)``): fit start in ``on_train_start``, epochs in
    ``on_train_epoch_start``, steps and task boundaries in ``on_train_batch_start``, plateaus in
    ``on_validation_end``. It accumulates ``G ← (1−ema_alpha)·G + ema_alpha·(−grad)`` over the first
    ``n_batches`` of the training dataloader (the model's ``training_step``, logging muted, no
    optimizer step), averages ``G`` over ranks, and multiplies each row (conv: each (out, in) kernel
    slice) by ``clamp(cos(G, W), lam, 1)``. ``gradient_mode="eval"`` runs that pass with the model in
    eval mode, as the reference code does (its pass follows an evaluation, which leaves the model in
    eval mode: dropout off, BatchNorm on running statistics); ``"train"`` runs it in train mode
    (BatchNorm on batch statistics). Gradients, train/eval modes, buffers (BatchNorm statistics)
    and the RNG state are restored afterwards; optimizer state is left alone, as in the paper. It
    needs one training dataloader and a ``training_step`` that returns the loss (or a dict with
    ``"loss"``); under manual optimization ``training_step`` runs as written, with every
    optimizer's and scheduler's ``step``/``zero_grad`` made a no-op for the pass (a closure passed
    to ``step`` still runs), and its ``manual_backward`` gives the gradient.

    Targets: :func:`plasticity_callbacks.core.model_map.select_targets` (``scope``/``include``/``exclude``
    as in FIREReinit). With ``shrink_bias=True`` a selected layer's bias is shrunk too, by one
    factor computed from the whole bias vector, as the paper does.

    Muon: ``skip_muon_params=True`` leaves alone every weight that ``torch.optim.Muon`` optimizes
    (a layer is skipped with its bias). With ``False`` those weights are shrunk as well: Muon's
    next updates keep their fixed, norm-independent size and the momentum buffer still holds
    pre-shrink gradients, so a shrunk row receives a relatively larger update; accept this only
    with rare shrinks (``every_n_steps`` of 2000 or more).

    Logs (prefix ``dash_periodic/`` or ``dash/``): ``shrinks`` (events so far), ``shrunk`` and
    ``shrunk_fraction`` (rows / kernel slices with factor < 1), ``factor_min``, and per layer
    ``<layer>/factor_mean``, ``<layer>/factor_min``, ``<layer>/shrunk``. Sharded strategies
    (FSDP, DeepSpeed) are refused at setup: rows would be split across shards.

    Args:
        rule: ``periodic`` (current gradient, penalty on misaligned rows) or ``dash`` (the paper's).
        schedule: when to act (a Schedule or a mapping of its fields); None: the rule's default above.
        alpha: periodic: cosine threshold above which a row is shrunk.
        rate: periodic: shrink per unit of cosine above ``alpha``.
        floor: periodic: smallest factor in one event.
        lam: dash: smallest factor λ.
        ema_alpha: dash: EMA coefficient of the negative gradient, in (0, 1].
        n_batches: dash: training batches averaged (None: one full pass).
        scope: ``all`` | ``attention`` | ``mlp``: which weights.
        include: ``fnmatch`` patterns on parameter names to keep.
        exclude: ``fnmatch`` patterns on parameter names to leave alone.
        include_conv: also conv kernels.
        include_head: also the output head.
        shrink_bias: also shrink a selected layer's bias, by one factor from the whole bias vector.
        skip_muon_params: leave alone the weights that ``torch.optim.Muon`` optimizes.
        log_per_layer: also log the factors per layer.
        gradient_mode: dash: the gradient pass in ``eval`` mode (the reference code) or ``train`` mode.

    Example:
        >>> dash = DASHShrink(rule="periodic", schedule=Schedule(every_n_steps=2000))
        >>> trainer = L.Trainer(max_steps=10_000, callbacks=[dash])
        >>> trainer.fit(module, datamodule=data)
    """

    def __init__(
        self,
        rule: str = "periodic",
        schedule: Schedule | Mapping | None = None,
        alpha: float = 0.05,
        rate: float = 0.005,
        floor: float = 0.5,
        lam: float = 0.3,
        ema_alpha: float = 0.3,
        n_batches: int | None = 32,
        scope: str = "all",
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        include_conv: bool = True,
        include_head: bool = False,
        shrink_bias: bool = True,
        skip_muon_params: bool = True,
        log_per_layer: bool = True,
        gradient_mode: str = "eval",
    ):
        if rule not in RULES:
            raise ValueError(f"rule={rule!r} is not one of {RULES}")
        if schedule is None:
            schedule = Schedule(every_n_steps=2000) if rule == "periodic" else Schedule(at_fit_start=True)
        self.schedule = Schedule.build(schedule, "DASHShrink")
        if rule == "periodic":
            self.schedule.require_step_triggers("DASHShrink(rule='periodic')",
                                                "uses the step's gradient (rule='dash' acts at any trigger)")
        self.selection = Selection(scope=scope, include=include, exclude=exclude, include_conv=include_conv,
                                   include_head=include_head)
        check_int("n_batches", n_batches, optional=True, hint="(None = one full pass)")
        check_number("alpha", alpha, -1.0, 1.0, "(a cosine threshold)")
        check_number("rate", rate, 0.0)
        check_number("floor", floor, 0.0, 1.0)
        check_number("lam", lam, 0.0, 1.0)
        check_number("ema_alpha", ema_alpha, 0.0, 1.0)
        if ema_alpha == 0:
            raise ValueError("ema_alpha=0 must lie in (0, 1]: the EMA would never see a gradient")
        for name, value in (("include_conv", include_conv), ("include_head", include_head),
                            ("shrink_bias", shrink_bias), ("skip_muon_params", skip_muon_params),
                            ("log_per_layer", log_per_layer)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true or false")
        if gradient_mode not in GRADIENT_MODES:
            raise ValueError(f"gradient_mode={gradient_mode!r} is not one of {GRADIENT_MODES}")
        include = list(include) if include is not None else None  # any Sequence -> a plain list (pickles)
        exclude = list(exclude) if exclude is not None else None
        self.rule = rule
        self.alpha, self.rate, self.floor = alpha, rate, floor
        self.lam, self.ema_alpha, self.n_batches = lam, ema_alpha, n_batches
        self.scope, self.include, self.exclude = scope, include, exclude
        self.include_conv, self.include_head, self.shrink_bias = include_conv, include_head, shrink_bias
        self.skip_muon_params, self.log_per_layer = skip_muon_params, log_per_layer
        self.gradient_mode = gradient_mode
        self.prefix = "dash_periodic" if rule == "periodic" else "dash"
        self.firing = ScheduleState(self.schedule, "DASHShrink")
        self._layers: list[_Layer] = []
        # Counters saved in checkpoints.
        self.shrinks = 0
        self.skipped_nonfinite = 0
        self.last_shrink_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(rule=self.rule, schedule=self.schedule.describe(), scope=self.scope,
                                        include=self.include, exclude=self.exclude)

    # ----------------------------------------------------------------------------------- hooks

    def setup(self, trainer, pl_module, stage: str) -> None:
        self.firing.begin_fit(stage)
        # Row-wise math would run under FSDP on flat shards whose rows are split: refuse, as FIRE does.
        require_full_parameters(trainer, "DASHShrink")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._layers = self._select_layers(trainer, pl_module)  # optimizers exist only from here on

    def on_train_start(self, trainer, pl_module) -> None:
        self._paper_shrink_if(self.firing.due_at_train_start(trainer), trainer, pl_module)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._paper_shrink_if(self.firing.due_at_epoch_start(trainer), trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.rule == "dash":
            self._paper_shrink_if(self.firing.due_at_step(trainer), trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        self._paper_shrink_if(self.firing.due_at_validation_end(trainer, pl_module), trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.rule != "periodic" or self.firing.due_at_step(trainer) is None:
            return
        if not _all_finite([p.grad for p in pl_module.parameters() if p.grad is not None]):
            self.skipped_nonfinite += 1
            return

        def factors(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            return penalty_shrink_factors(weight, grad, self.alpha, self.rate, self.floor)

        self._shrink(trainer, pl_module, lambda param: param.grad, factors, on_step=True)

    def state_dict(self) -> dict:
        return {"schedule": self.firing.state_dict(), "shrinks": self.shrinks,
                "skipped_nonfinite": self.skipped_nonfinite, "last_shrink_step": self.last_shrink_step}

    def load_state_dict(self, state_dict: dict) -> None:
        check_state(self, state_dict, {"schedule": dict, "shrinks": int, "skipped_nonfinite": int,
                                       "last_shrink_step": int})
        self.firing.load_state_dict(state_dict["schedule"])
        self.shrinks = state_dict["shrinks"]
        self.skipped_nonfinite = state_dict["skipped_nonfinite"]
        self.last_shrink_step = state_dict["last_shrink_step"]

    # ------------------------------------------------------------------------------- internals

    def _select_layers(self, trainer, pl_module) -> list[_Layer]:
        targets = require_targets(
            select_targets(pl_module, self.selection), "DASHShrink", self.selection)
        if self.skip_muon_params:
            targets = [t for t in targets
                       if not isinstance(owning_optimizer(trainer.optimizers, t.param), torch.optim.Muon)]
            if not targets:
                raise ValueError("DASHShrink: every selected weight is optimized by torch.optim.Muon and "
                                 "skip_muon_params=True; set skip_muon_params=False, or select AdamW-managed "
                                 "weights (e.g. include_head=True)")
        module_names = {id(m): n for n, m in pl_module.named_modules()}
        layers = []
        for t in targets:
            bias = getattr(t.module, "bias", None) if t.kind in ("linear", "conv") and self.shrink_bias else None
            bias = bias if isinstance(bias, nn.Parameter) and bias.requires_grad else None
            layers.append(_Layer(module_names[id(t.module)] if t.kind != "matrix" else t.name, t, bias))
        return layers

    def _shrink(self, trainer, pl_module, direction_of, factor_fn, on_step: bool) -> None:
        """Shrink every selected layer in place by ``factor_fn(weight, direction)`` and log the factors.

        ``direction_of(param)`` gives the gradient-like tensor stored like ``param`` (or None to skip);
        weights and directions are compared in ``(out, in)`` orientation, one factor per output neuron.
        """
        refuse_factorized([layer.view for layer in self._layers], "DASHShrink",
                          "DASH needs the gradient of the effective weight")
        stats = []
        with torch.no_grad():
            for layer in self._layers:
                direction = direction_of(layer.weight)
                if direction is None:
                    continue
                weight = layer.view.read()  # a view: shrinking it shrinks the parameter
                weight_factors = factor_fn(weight, layer.view.oriented(direction))
                apply_shrink_(weight, weight_factors)
                if layer.bias is not None and (bias_direction := direction_of(layer.bias)) is not None:
                    apply_shrink_(layer.bias, factor_fn(layer.bias, bias_direction))
                stats.append((layer.name, weight_factors.detach().flatten()))
        if not stats:  # never a silent no-op: no selected weight had a gradient
            rank_zero_warn(f"DASHShrink: no selected weight had a gradient at step {trainer.global_step}, nothing was "
                           "shrunk; are they frozen (requires_grad=False) or unused in training_step?")
        self.shrinks += 1
        self.last_shrink_step = trainer.global_step
        self._log(pl_module, stats, on_step)

    def _log(self, pl_module, stats, on_step: bool) -> None:
        if not stats:
            return
        opts = dict(on_step=on_step, on_epoch=not on_step, sync_dist=False)  # identical on every rank already
        every = torch.cat([f for _, f in stats])
        shrunk = (every < 1).sum().float()
        pl_module.log(f"{self.prefix}/shrinks", float(self.shrinks), **opts)
        pl_module.log(f"{self.prefix}/shrunk", shrunk, **opts)
        pl_module.log(f"{self.prefix}/shrunk_fraction", shrunk / every.numel(), **opts)
        pl_module.log(f"{self.prefix}/factor_min", every.min(), **opts)
        if self.log_per_layer:
            for name, f in stats:
                pl_module.log(f"{self.prefix}/{name}/factor_mean", f.mean(), **opts)
                pl_module.log(f"{self.prefix}/{name}/factor_min", f.min(), **opts)
                pl_module.log(f"{self.prefix}/{name}/shrunk", (f < 1).sum().float(), **opts)

    def _paper_shrink_if(self, reason: str | None, trainer, pl_module) -> None:
        if reason is not None and self.rule == "dash":
            self._paper_shrink(trainer, pl_module)

    def _paper_shrink(self, trainer, pl_module) -> None:
        directions = self._negative_gradient_ema(trainer, pl_module)
        if directions is None:
            return

        def factors(weight: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
            return dash_shrink_factors(weight, direction, self.lam)

        self._shrink(trainer, pl_module, directions.get, factors, on_step=False)

    def _negative_gradient_ema(self, trainer, pl_module) -> dict[torch.Tensor, torch.Tensor] | None:
        """EMA of −grad over ``n_batches`` training batches, mean over ranks; ``None`` if no batch was finite."""
        loader = trainer.train_dataloader
        if isinstance(loader, (Mapping, list, tuple)):
            raise ValueError("DASHShrink(rule='dash') needs a single training dataloader, got "
                             f"{type(loader).__name__}")
        tracked = [p for layer in self._layers for p in (layer.weight, layer.bias) if p is not None]
        ema = [torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32)) for p in tracked]
        params = list(pl_module.parameters())
        saved_grads = [p.grad for p in params]
        modes = {m: m.training for m in pl_module.modules()}
        buffers = [b.detach().clone() for b in pl_module.buffers()]
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16: scale the loss so small grads survive
        used = 0
        manual = not pl_module.automatic_optimization
        rng_devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=rng_devices), _muted_logging(pl_module), _frozen_optimizers(trainer):
                pl_module.train(self.gradient_mode == "train")
                for batch_idx, batch in enumerate(loader):
                    if self.n_batches is not None and batch_idx >= self.n_batches:
                        break
                    for p in params:
                        p.grad = None
                    # as the training loop does: to the device, then to the precision's dtype (bf16-true)
                    batch = trainer.precision_plugin.convert_input(trainer.strategy.batch_to_device(batch))
                    with trainer.precision_plugin.train_step_context():
                        out = pl_module.training_step(batch, batch_idx)
                    if manual:  # training_step called self.manual_backward; its optimizer steps were no-ops
                        if not any(p.grad is not None for p in tracked):
                            raise RuntimeError("DASHShrink(rule='dash'): under manual optimization training_step "
                                               "left no gradient on the selected weights; it must call "
                                               "self.manual_backward(loss)")
                    else:
                        loss = out["loss"] if isinstance(out, Mapping) else out
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tracked]
                    if not _all_finite(grads):
                        continue  # an fp16 overflow batch would poison the average
                    for g_ema, grad in zip(ema, grads):
                        g_ema.mul_(1 - self.ema_alpha).add_(grad.to(g_ema.dtype), alpha=-self.ema_alpha)
                    used += 1
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
            for m, training in modes.items():
                m.train(training)
            with torch.no_grad():
                for b, saved in zip(pl_module.buffers(), buffers):
                    b.copy_(saved)
        # Each rank saw its own shard; the EMA is linear, so the mean of the ranks' EMAs is the EMA of
        # the mean gradient. One collective for everything, plus the batch count so all ranks agree.
        flat = torch.cat([g.flatten() for g in ema] + [torch.tensor([float(used)], device=ema[0].device,
                                                                    dtype=ema[0].dtype)])
        flat = all_reduce_mean(trainer, flat)
        if float(flat[-1]) == 0.0:
            rank_zero_warn("DASHShrink: no training batch gave finite gradients; skipped the shrink")
            return None
        chunks = flat[:-1].split([g.numel() for g in ema])
        return {p: c.view_as(p) for p, c in zip(tracked, chunks)}


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """One host sync: the max-abs norm is finite exactly when every entry is."""
    if not tensors:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=math.inf)))


@contextmanager
def _frozen_optimizers(trainer):
    """Optimizer and scheduler ``step``/``zero_grad`` become no-ops (a closure still runs): under manual
    optimization ``training_step`` steps the user's optimizer itself, which the gradient pass must not do."""
    optimizers = [*trainer.optimizers, *getattr(trainer.strategy, "_lightning_optimizers", [])]
    schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]

    def step(closure=None, **kwargs):
        return closure() if closure is not None else None

    def nothing(*args, **kwargs):
        return None

    patched = [(opt, "step", step) for opt in optimizers] + [(opt, "zero_grad", nothing) for opt in optimizers]
    patched += [(scheduler, "step", nothing) for scheduler in schedulers]
    for obj, name, replacement in patched:
        setattr(obj, name, replacement)  # an instance attribute shadows the method
    try:
        yield
    finally:
        for obj, name, _ in patched:
            if name in vars(obj):
                delattr(obj, name)


@contextmanager
def _muted_logging(pl_module):
    """The data pass calls ``training_step``, whose ``self.log`` calls must not reach the run's metrics."""
    def silent(*args, **kwargs):
        return None

    pl_module.log, pl_module.log_dict = silent, silent  # instance attributes shadow the methods
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
