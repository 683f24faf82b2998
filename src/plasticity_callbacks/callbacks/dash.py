"""``DASHShrink``: shrink neurons whose weights point against the descent direction (DASH, the paper's rule).

The math lives in :mod:`plasticity_callbacks.functional.shrink`; this file decides when and on what.
:class:`DirectionalShrink` is what this rule shares with the per-step rule in :mod:`.dash_periodic`.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import ClassVar

import torch
from lightning.pytorch.utilities import rank_zero_warn

from ..arguments import check_int, check_number
from ..distributed.strategy import all_reduce_mean, is_dtensor
from ..ops.minor_gradient import full_gradients
from ..model_map import Selection
from ..ops.dash import DASH_THROUGH, ShrinkLayer, shrink_layers, shrink_layers_
from .schedule import Schedule
from ..distributed.sharding import all_finite_on_every_rank
from ..functional.shrink import dash_shrink_factors
from .base import PlasticityCallback

GRADIENT_MODES = ("eval", "train")  # the mode of the paper rule's gradient pass


class DirectionalShrink(PlasticityCallback, abstract=True):
    """What both DASH rules share: the selected layers, the shrink itself, its metrics and counters.

    A rule subclasses it, names its log ``prefix`` and writes ``act``, which calls :meth:`shrink`
    with the direction of each weight and the rule's factor function.

    Args:
        schedule: when to act (a Schedule or a mapping of its fields); None: the rule's default.
        selection: which weights (:class:`~model_map.Selection` or a mapping).
        shrink_bias: also shrink a selected layer's bias, by one factor from the whole bias vector.
        skip_muon_params: leave alone the weights that ``torch.optim.Muon`` optimizes.
        log_per_layer: also log the factors per layer.

    Example:
        >>> class Halve(DirectionalShrink):
        ...     prefix = "halve"
        ...     def act(self, trainer, pl_module, reason):
        ...         return self.shrink(trainer, lambda p: p.grad, lambda w, d: torch.full(w.shape[:1], 0.5))
    """

    prefix: ClassVar[str] = "dash"
    acts_through = DASH_THROUGH  # weight norm shrunk through g; the others refused by name, with why
    extra_state_types = {"shrinks": int, "skipped_nonfinite": int, "last_shrink_step": int}

    def __init__(self, schedule: Schedule | Mapping | None = None, selection: Selection | Mapping | None = None,
                 shrink_bias: bool = True, skip_muon_params: bool = True, log_per_layer: bool = True):
        super().__init__(schedule, Selection.build(selection, self.owner))
        for name, value in (("shrink_bias", shrink_bias), ("skip_muon_params", skip_muon_params),
                            ("log_per_layer", log_per_layer)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true or false")
        self.shrink_bias, self.skip_muon_params, self.log_per_layer = shrink_bias, skip_muon_params, log_per_layer
        self._layers: list[ShrinkLayer] = []
        self.shrinks = 0
        self.skipped_nonfinite = 0
        self.last_shrink_step = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(schedule=self.schedule.describe(), scope=self.selection.scope,
                                        include=self.selection.include, exclude=self.selection.exclude)

    def attach(self, trainer, pl_module) -> None:
        self._layers = self._select_layers(trainer, pl_module)  # optimizers exist only from here on

    def skip_nonfinite(self, trainer, pl_module, what: str) -> bool:
        skip = super().skip_nonfinite(trainer, pl_module, what)
        self.skipped_nonfinite += int(skip)  # counted in the state: a resumed run reports the same
        return skip

    def extra_state(self) -> dict:
        return {"shrinks": self.shrinks, "skipped_nonfinite": self.skipped_nonfinite,
                "last_shrink_step": self.last_shrink_step}

    def load_extra_state(self, state: dict) -> None:
        self.shrinks = state["shrinks"]
        self.skipped_nonfinite = state["skipped_nonfinite"]
        self.last_shrink_step = state["last_shrink_step"]

    def _select_layers(self, trainer, pl_module) -> list[ShrinkLayer]:
        return shrink_layers(pl_module, self.selection, trainer.optimizers, self.shrink_bias, self.skip_muon_params,
                             self.owner)

    def shrink(self, trainer, direction_of, factor_fn) -> dict[str, torch.Tensor]:
        """Shrink every selected layer in place by ``factor_fn(weight, direction)``
        (:func:`~ops.dash.shrink_layers_`); return the metrics.

        ``direction_of(param)`` gives the gradient-like tensor stored like ``param`` (or None to skip);
        weights and directions are compared in ``(out, in)`` orientation, one factor per output neuron.
        """
        stats = shrink_layers_(self._layers, direction_of, factor_fn, self.owner)
        if not stats:  # never a silent no-op: no selected weight had a gradient
            rank_zero_warn(f"{self.owner}: no selected weight had a gradient at step {trainer.global_step}, nothing "
                           "was shrunk; are they frozen (requires_grad=False) or unused in training_step?")
        self.shrinks += 1
        self.last_shrink_step = trainer.global_step
        return self._metrics(stats)

    def _metrics(self, stats) -> dict[str, torch.Tensor | float]:
        if not stats:
            return {}
        every = torch.cat([f for _, f in stats])
        shrunk = (every < 1).sum().float()
        metrics = {f"{self.prefix}/shrinks": float(self.shrinks), f"{self.prefix}/shrunk": shrunk,
                   f"{self.prefix}/shrunk_fraction": shrunk / every.numel(), f"{self.prefix}/factor_min": every.min()}
        if self.log_per_layer:
            for name, f in stats:
                metrics[f"{self.prefix}/{name}/factor_mean"] = f.mean()
                metrics[f"{self.prefix}/{name}/factor_min"] = f.min()
                metrics[f"{self.prefix}/{name}/shrunk"] = (f < 1).sum().float()
        return metrics


class DASHShrink(DirectionalShrink):
    """DASH (Shin et al., NeurIPS 2024): shrink neurons whose weights point against the data's descent direction.

    When: ``schedule``, any trigger (default ``Schedule(at_fit_start=True)``: a phase boundary); the
    hooks are :class:`~callbacks.base.PlasticityCallback`'s. Every trigger acts
    once, also across a resume.

    What changes: it accumulates ``G ← (1−gradient_ema_weight)·G + gradient_ema_weight·(−grad)`` over
    the first ``n_batches`` of the training dataloader (the model's ``training_step``, logging muted,
    no optimizer step), averages ``G`` over ranks, and multiplies each row (conv: each (out, in)
    kernel slice) of a selected weight by ``clamp(cos(G, W), min_factor, 1)``; with
    ``shrink_bias=True`` a selected layer's bias by one factor from the whole bias vector, as the
    paper does. ``gradient_mode="eval"`` runs that pass with the model in eval mode, as the
    reference code does (its pass follows an evaluation, which leaves the model in eval mode:
    dropout off, BatchNorm on running statistics); ``"train"`` runs it in train mode (BatchNorm on
    batch statistics). Gradients, train/eval modes, buffers (BatchNorm statistics) and the RNG
    state are restored afterwards; optimizer state is left alone, as in the paper. Frozen weights
    (``requires_grad=False``, a PEFT base) are not selected unless an ``include`` pattern names them, and a
    selected weight that got no gradient in the pass (frozen, unused) is left as it is, never read as a zero
    gradient, which would look misaligned and shrink it to ``min_factor``. It needs one
    training dataloader and a ``training_step`` that returns the loss (or a dict with ``"loss"``);
    under manual optimization ``training_step`` runs as written, with every optimizer's and
    scheduler's ``step``/``zero_grad`` made a no-op for the pass (a closure passed to ``step``
    still runs), and its ``manual_backward`` gives the gradient.

    Muon: ``skip_muon_params=True`` leaves alone every weight that ``torch.optim.Muon`` optimizes
    (a layer is skipped with its bias); with ``False`` they are shrunk too.

    Logs (prefix ``dash/``): ``shrinks`` (events so far), ``shrunk`` and ``shrunk_fraction`` (rows /
    kernel slices with factor < 1), ``factor_min``, and per layer ``<layer>/factor_mean``,
    ``<layer>/factor_min``, ``<layer>/shrunk``. Under FSDP2 (``ModelParallelStrategy``) the pass's
    gradients are FSDP2's reduce-scattered means, each rank keeps the EMA of the rows it holds and
    shrinks them (:func:`~distributed.sharding.sharded_shrink_`); FSDP1 and DeepSpeed are
    refused at setup. The per-step rule is :class:`~.dash_periodic.DASHPeriodic`.

    Args:
        schedule: when to act (a Schedule or a mapping of its fields); None: ``Schedule(at_fit_start=True)``.
        min_factor: the smallest factor λ in (0, 1] (paper: 0.3; 0 would zero a row).
        gradient_ema_weight: weight of each new negative gradient in the EMA ``G``, in (0, 1] (paper: 0.3).
        n_batches: training batches averaged (None: one full pass).
        selection: which weights (:class:`~model_map.Selection` or a mapping);
            None: every weight but the head.
        shrink_bias: also shrink a selected layer's bias, by one factor from the whole bias vector.
        skip_muon_params: leave alone the weights that ``torch.optim.Muon`` optimizes.
        log_per_layer: also log the factors per layer.
        gradient_mode: the gradient pass in ``eval`` mode (the reference code) or ``train`` mode.

    Raises:
        ValueError: a bad argument; at fit start, a selection that finds no weight (or only Muon's, with
            ``skip_muon_params``).
        RuntimeError: a selected weight factorized by ``AdaptiveSVDSwitch(minor_training="factorize")``.
        MisconfigurationException: at setup, under FSDP1 or DeepSpeed (flat shards), with the fix.

    Example:
        >>> dash = DASHShrink(min_factor=0.3, n_batches=None, selection={"include_head": True})
        >>> trainer = L.Trainer(max_steps=10_000, callbacks=[dash])
        >>> trainer.fit(module, datamodule=next_phase_data)   # shrinks once, before the first step
    """

    supports_fsdp2 = True  # FSDP2: each rank's rows (distributed.sharding.sharded_shrink_)
    quick_settings = {"n_batches": 2, "skip_muon_params": False}
    prefix = "dash"
    summary_metrics = ("dash/shrunk_fraction",)

    def __init__(
        self,
        schedule: Schedule | Mapping | None = None,
        min_factor: float = 0.3,
        gradient_ema_weight: float = 0.3,
        n_batches: int | None = 32,
        selection: Selection | Mapping | None = None,
        shrink_bias: bool = True,
        skip_muon_params: bool = True,
        log_per_layer: bool = True,
        gradient_mode: str = "eval",
    ):
        super().__init__(schedule, selection, shrink_bias, skip_muon_params, log_per_layer)
        check_int("n_batches", n_batches, optional=True, hint="(None = one full pass)")
        check_number("min_factor", min_factor, 0.0, 1.0, "(0 would zero a row: a dead neuron; paper: 0.3)", low_open=True)
        check_number("gradient_ema_weight", gradient_ema_weight, 0.0, 1.0, "(0: the EMA would never see a gradient)",
                     low_open=True)
        if gradient_mode not in GRADIENT_MODES:
            raise ValueError(f"gradient_mode={gradient_mode!r} is not one of {GRADIENT_MODES}")
        self.min_factor, self.gradient_ema_weight, self.n_batches = min_factor, gradient_ema_weight, n_batches
        self.gradient_mode = gradient_mode

    def act(self, trainer, pl_module, reason: str) -> dict[str, torch.Tensor | float]:
        directions = self._negative_gradient_ema(trainer, pl_module)
        if directions is None:
            return {}

        def factors(weight: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
            return dash_shrink_factors(weight, direction, self.min_factor)

        return self.shrink(trainer, directions.get, factors)

    def _negative_gradient_ema(self, trainer, pl_module) -> dict[torch.Tensor, torch.Tensor] | None:
        """EMA of −grad over ``n_batches`` training batches, mean over ranks; ``None`` if no batch was finite."""
        loader = trainer.train_dataloader
        if isinstance(loader, (Mapping, list, tuple)):
            raise ValueError("DASHShrink needs a single training dataloader, got "
                             f"{type(loader).__name__}")
        # weight norm: g's and v's directions, from which ops.dash rebuilds the forward weight's
        tracked = [p for layer in self._layers for p in (*_weights(layer), layer.bias) if p is not None]
        # FSDP2: the EMA of each rank's shard (its gradient is already the mean over ranks: reduce-scattered)
        ema = [torch.zeros_like(_local(p), dtype=torch.promote_types(p.dtype, torch.float32)) for p in tracked]
        # A weight that never got a gradient (frozen, or unused by training_step) has no direction to compare:
        # read as a zero gradient it would look misaligned and be shrunk to min_factor.
        seen = torch.zeros(len(tracked), device=ema[0].device, dtype=ema[0].dtype)
        params = list(pl_module.parameters())
        saved_grads = [p.grad for p in params]
        modes = {m: m.training for m in pl_module.modules()}
        buffers = [b.detach().clone() for b in pl_module.buffers()]
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16: scale the loss so small grads survive
        used = 0
        manual = not pl_module.automatic_optimization
        rng_devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        try:
            # full_gradients: AdaptiveSVD's taps lifted, so each weight's gradient is its whole gradient
            with torch.random.fork_rng(devices=rng_devices), _muted_logging(pl_module), _frozen_optimizers(trainer), \
                    full_gradients(pl_module):
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
                            raise RuntimeError("DASHShrink: under manual optimization training_step "
                                               "left no gradient on the selected weights; it must call "
                                               "self.manual_backward(loss)")
                    else:
                        loss = out["loss"] if isinstance(out, Mapping) else out
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tracked]
                    seen += torch.tensor([float(p.grad is not None) for p in tracked], device=seen.device,
                                         dtype=seen.dtype)
                    if not all_finite_on_every_rank(grads):
                        continue  # an fp16 overflow batch would poison the average
                    for g_ema, grad in zip(ema, grads):
                        g_ema.mul_(1 - self.gradient_ema_weight).add_(_local(grad).to(g_ema.dtype),
                                                                      alpha=-self.gradient_ema_weight)
                    used += 1
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
            for m, training in modes.items():
                m.train(training)
            with torch.no_grad():
                for b, saved in zip(pl_module.buffers(), buffers):
                    b.copy_(saved)
        # Each rank saw its own data; the EMA is linear, so the mean of the ranks' EMAs is the EMA of
        # the mean gradient. One collective for everything, plus the batch count so all ranks agree.
        # A DTensor's gradient was averaged by FSDP2 already, and its EMA covers this rank's rows only.
        replicated = [g for p, g in zip(tracked, ema) if not is_dtensor(p)]
        flat = torch.cat([g.flatten() for g in replicated] + [seen, torch.tensor([float(used)], device=ema[0].device,
                                                                                dtype=ema[0].dtype)])
        flat = all_reduce_mean(trainer, flat)
        if float(flat[-1]) == 0.0:
            rank_zero_warn("DASHShrink: no training batch gave finite gradients; skipped the shrink")
            return None
        means = iter(flat[:-1 - len(tracked)].split([g.numel() for g in replicated]))
        directions = [_as_sharded(g, p) if is_dtensor(p) else next(means).view_as(p) for p, g in zip(tracked, ema)]
        got = flat[-1 - len(tracked):-1].tolist()
        return {p: g for p, g, n in zip(tracked, directions, got) if n > 0}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _as_sharded(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard ``local`` as a DTensor placed like the parameter ``like``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())


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

    # Instance attributes shadow the methods; ones already there (an adapter's, e.g. the HF Trainer's) come back after.
    shadowed = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.log, pl_module.log_dict = silent, silent
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        pl_module.__dict__.update(shadowed)


def _weights(layer: ShrinkLayer) -> list[torch.Tensor]:
    """The tensors whose directions DASH reads for a layer's weight: the weight, or its parametrization's originals."""
    return list(layer.view.through.originals) if layer.view.through is not None else [layer.weight]
