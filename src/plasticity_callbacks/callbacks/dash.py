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
from ..core.model_map import WeightView, refuse_factorized, require_targets, select_targets, validate_selection
from ..core.arguments import check_int, check_number, sorted_int_list
from ..core.callback_state import check_state

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
    """Direction-aware shrinking, with the seed's periodic rule or the DASH paper's rule.

    ``rule="periodic"`` (seed design log 000) acts in ``on_before_optimizer_step`` just before
    the optimizer steps that complete step ``every_n_steps``, ``2·every_n_steps``, ... (counted in
    optimizer steps, so once per real step under gradient accumulation). It multiplies every
    row (conv: every (out, in) kernel slice) of a selected weight by
    ``clamp(1 − rate·clamp(cos(W, grad) − alpha, 0), floor, 1)`` using the current gradient. At that hook the gradients are already all-reduced under DDP
    and, with ``precision="16-mixed"``, already unscaled by Lightning's AMP plugin (it calls
    ``scaler.unscale_`` before the hook; an optimizer that unscales inside its own ``step`` would
    leave them scaled, which a cosine does not notice). A scheduled step whose gradients (any
    parameter's) are not all finite is skipped, not postponed: the AMP scaler would skip it too.

    ``rule="dash"`` (Shin et al., NeurIPS 2024) acts in ``on_train_start`` (``at_start``; not again
    when the fit resumes from a checkpoint written after it) and/or ``on_train_epoch_start`` for
    the epochs in ``at_epochs``. It accumulates ``G ← (1−ema_alpha)·G + ema_alpha·(−grad)`` over
    the first ``n_batches`` of the training dataloader (the model's ``training_step``, logging
    muted, no optimizer step), averages ``G`` over ranks, and multiplies each row
    (conv: each (out, in) kernel slice) by ``clamp(cos(G, W), lam, 1)``. ``gradient_mode="eval"``
    runs that pass with the model in eval mode, as the reference code does (its pass follows an
    evaluation, which leaves the model in eval mode: dropout off, BatchNorm on running statistics);
    ``"train"`` runs it in train mode (BatchNorm on batch statistics). Gradients, train/eval
    modes, buffers (BatchNorm statistics) and the RNG state are restored afterwards; optimizer
    state is left alone, as in the paper. It needs one training dataloader and a ``training_step``
    that returns the loss (or a dict with ``"loss"``); under manual optimization ``training_step``
    runs as written, with every optimizer's and scheduler's ``step``/``zero_grad`` made a no-op for
    the pass (a closure passed to ``step`` still runs), and its ``manual_backward`` gives the gradient.
    A fit resumed with ``ckpt_path`` counts as
    the same phase; a new ``trainer.fit`` in the same process (a new phase) shrinks again.

    Targets: :func:`plasticity_callbacks.core.model_map.select_targets` (``scope``/``include``/``exclude``
    as in FIREReinit). With ``shrink_bias=True`` a selected layer's bias is shrunk too, by one
    factor computed from the whole bias vector (the paper does this; the seed had no biases).

    Muon: ``skip_muon_params=True`` leaves alone every weight that ``torch.optim.Muon`` optimizes
    (seed "option A"; a layer is skipped with its bias). With ``False`` those weights are shrunk
    as well: Muon's next updates keep their fixed, norm-independent size and the momentum buffer
    still holds pre-shrink gradients, so a shrunk row receives a relatively larger update; the
    seed's "option B" is to accept this only with a large ``every_n_steps`` (2000+).

    Logs (prefix ``dash_periodic/`` or ``dash/``): ``shrinks`` (events so far), ``shrunk`` and
    ``shrunk_fraction`` (rows / kernel slices with factor < 1), ``factor_min``, and per layer
    ``<layer>/factor_mean``, ``<layer>/factor_min``, ``<layer>/shrunk``. Sharded strategies
    (FSDP, DeepSpeed) are refused at setup: rows would be split across shards.

    Example:
        >>> dash = DASHShrink(rule="periodic", every_n_steps=2000)
        >>> trainer = L.Trainer(max_steps=10_000, callbacks=[dash])
        >>> trainer.fit(module, datamodule=data)
    """

    def __init__(
        self,
        rule: str = "periodic",
        every_n_steps: int = 2000,
        alpha: float = 0.05,
        rate: float = 0.005,
        floor: float = 0.5,
        lam: float = 0.3,
        ema_alpha: float = 0.3,
        n_batches: int | None = 32,
        at_start: bool = True,
        at_epochs: Sequence[int] | None = None,
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
        validate_selection(scope, include, exclude)
        check_int("every_n_steps", every_n_steps)
        check_int("n_batches", n_batches, optional=True, hint="(None = one full pass)")
        check_number("alpha", alpha, -1.0, 1.0, "(a cosine threshold)")
        check_number("rate", rate, 0.0)
        check_number("floor", floor, 0.0, 1.0)
        check_number("lam", lam, 0.0, 1.0)
        check_number("ema_alpha", ema_alpha, 0.0, 1.0)
        if ema_alpha == 0:
            raise ValueError("ema_alpha=0 must lie in (0, 1]: the EMA would never see a gradient")
        for name, value in (("at_start", at_start), ("include_conv", include_conv), ("include_head", include_head),
                            ("shrink_bias", shrink_bias), ("skip_muon_params", skip_muon_params),
                            ("log_per_layer", log_per_layer)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be true or false")
        if gradient_mode not in GRADIENT_MODES:
            raise ValueError(f"gradient_mode={gradient_mode!r} is not one of {GRADIENT_MODES}")
        at_epochs = sorted_int_list("at_epochs", at_epochs)
        if rule == "periodic" and at_epochs:
            raise ValueError("at_epochs applies to rule='dash'; rule='periodic' acts every every_n_steps steps")
        if rule == "dash" and not at_start and not at_epochs:
            raise ValueError("rule='dash' needs at_start=True or some at_epochs, otherwise it never acts")
        include = list(include) if include is not None else None  # Hydra ListConfig -> plain list (pickles)
        exclude = list(exclude) if exclude is not None else None
        self.rule, self.every_n_steps = rule, every_n_steps
        self.alpha, self.rate, self.floor = alpha, rate, floor
        self.lam, self.ema_alpha, self.n_batches = lam, ema_alpha, n_batches
        self.at_start, self.at_epochs = at_start, at_epochs
        self.scope, self.include, self.exclude = scope, include, exclude
        self.include_conv, self.include_head, self.shrink_bias = include_conv, include_head, shrink_bias
        self.skip_muon_params, self.log_per_layer = skip_muon_params, log_per_layer
        self.gradient_mode = gradient_mode
        self.prefix = "dash_periodic" if rule == "periodic" else "dash"
        self._layers: list[_Layer] = []
        # Counters saved in checkpoints.
        self.shrinks = 0
        self.skipped_nonfinite = 0
        self.last_shrink_step = -1
        self.start_done = False
        self.epochs_done: list[int] = []
        self._resumed_after_start = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(rule=self.rule, every_n_steps=self.every_n_steps, at_epochs=self.at_epochs,
                                        scope=self.scope, include=self.include, exclude=self.exclude)

    # ----------------------------------------------------------------------------------- hooks

    def setup(self, trainer, pl_module, stage: str) -> None:
        # Row-wise math would run under FSDP on flat shards whose rows are split: refuse, as FIRE does.
        require_full_parameters(trainer, "DASHShrink")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._layers = self._select_layers(trainer, pl_module)  # optimizers exist only from here on

    def on_train_start(self, trainer, pl_module) -> None:
        resumed, self._resumed_after_start = self._resumed_after_start, False
        if self.rule == "dash" and self.at_start and not resumed:
            self._paper_shrink(trainer, pl_module)
            self.start_done = True

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        epoch = trainer.current_epoch
        if self.rule != "dash" or epoch not in self.at_epochs or epoch in self.epochs_done:
            return
        self.epochs_done.append(epoch)
        if self.last_shrink_step != trainer.global_step:  # at_start already shrank at this very point
            self._paper_shrink(trainer, pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.rule != "periodic" or (trainer.global_step + 1) % self.every_n_steps:
            return
        if not _all_finite([p.grad for p in pl_module.parameters() if p.grad is not None]):
            self.skipped_nonfinite += 1
            return

        def factors(weight: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
            return penalty_shrink_factors(weight, grad, self.alpha, self.rate, self.floor)

        self._shrink(trainer, pl_module, lambda param: param.grad, factors, on_step=True)

    def state_dict(self) -> dict:
        return {"shrinks": self.shrinks, "skipped_nonfinite": self.skipped_nonfinite,
                "last_shrink_step": self.last_shrink_step, "start_done": self.start_done,
                "epochs_done": list(self.epochs_done)}

    def load_state_dict(self, state_dict: dict) -> None:
        check_state(self, state_dict, {"shrinks": int, "skipped_nonfinite": int, "last_shrink_step": int,
                                       "start_done": bool, "epochs_done": list})
        self.shrinks = state_dict["shrinks"]
        self.skipped_nonfinite = state_dict["skipped_nonfinite"]
        self.last_shrink_step = state_dict["last_shrink_step"]
        self.start_done = state_dict["start_done"]
        self.epochs_done = list(state_dict["epochs_done"])
        self._resumed_after_start = self.start_done  # the resumed fit is the same phase: no second shrink

    # ------------------------------------------------------------------------------- internals

    def _select_layers(self, trainer, pl_module) -> list[_Layer]:
        targets = require_targets(
            select_targets(pl_module, self.scope, self.include, self.exclude, self.include_conv, self.include_head),
            "DASHShrink", self.scope, self.include, self.exclude)
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
