"""``FIREReinit``: Frobenius-isometry reinitialization (FIRE) at chosen moments of training."""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..core.distributed import all_reduce_mean, require_full_parameters
from ..functional.isometry import FireRecord, apply_fire, validate_fire_options
from ..core.optimizer_state import leaf_optimizers
from ..functional.spectral import DEFAULT_NORMALIZE, NORMALIZATIONS
from ..core.model_map import require_targets, select_targets, validate_selection
from ..core.arguments import check_int, sorted_int_list
from ..core.callback_state import OPTIONAL_INT, OPTIONAL_NUMBER, check_state

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


class FIREReinit(L.Callback):
    """Replace the selected weights by ``scale · polar(W)``, the nearest isometry, and reset their optimizer state.

    When (any combination; each application happens once, also across a resume):
      * ``at_fit_start``: in ``on_train_start`` (a phase boundary: the fit continues from earlier
        weights). A fit resumed with ``ckpt_path`` whose checkpoint already records it does not repeat it.
      * ``epochs`` / ``every_n_epochs``: in ``on_train_epoch_start`` of those epochs (0-based; ``every_n_epochs``
        skips epoch 0).
      * ``steps``: in ``on_train_batch_start`` once ``trainer.global_step`` (optimizer steps taken) equals one.
      * ``monitor``: in ``on_validation_end`` when the (rank-averaged) metric has not improved by
        ``min_delta`` for ``patience`` validations (EarlyStopping's rule); then ``cooldown`` validations
        pass before counting again, and the best value restarts from the post-FIRE loss.

    What changes: the target weights (see :func:`plasticity_callbacks.functional.isometry.apply_fire`) and the
    optimizer state of exactly those weights (``reset_optimizer``). With ``rewarmup_steps = K`` the
    learning rate of the next K optimizer steps is multiplied by ``(i+1)/K``: a pre-step hook on
    each optimizer scales every group's ``lr`` and a post-step hook restores it, before any LR
    scheduler steps, so the user's scheduler is neither replaced nor disturbed.
    Logged (through ``pl_module.log``, at the next training batch): ``fire/dfi_before``,
    ``fire/dfi_after`` (mean over layers), ``fire/sfe``, ``fire/sfe_normalized``, ``fire/seconds``
    (rank mean), ``fire/applications``, and per layer with ``log_per_layer``. ``save_spectra``
    saves singular-value spectra before/after as a figure in the logger's directory.
    Every rank computes the same deterministic result; sharded strategies are refused at setup.

    Example:
        >>> fire = FIREReinit(at_fit_start=True, scope="attention", method="polar_express")
        >>> trainer = L.Trainer(callbacks=[fire], max_steps=1000)
        >>> trainer.fit(model, datamodule=next_phase_data)
    """

    def __init__(
        self,
        at_fit_start: bool = True,
        epochs: Sequence[int] | None = None,
        every_n_epochs: int | None = None,
        steps: Sequence[int] | None = None,
        monitor: str | None = None,
        patience: int = 3,
        min_delta: float = 0.0,
        mode: str = "min",
        cooldown: int = 0,
        max_plateau_applications: int | None = None,
        scope: str = "all",
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        include_conv: bool = True,
        include_head: bool = False,
        method: str = "polar_express",
        normalize: str | None = None,
        iters: int | None = None,
        tol: float | None = 1e-5,
        check_every: int = 1,
        dtype: str = "float32",
        scale: str | float = "sqrt_dout_din",
        on_degenerate: str = "skip",
        reset_optimizer: bool = True,
        rewarmup_steps: int = 0,
        log_per_layer: bool = False,
        save_spectra: bool = False,
    ):
        super().__init__()
        self.epochs = sorted_int_list("epochs", epochs)
        self.steps = sorted_int_list("steps", steps)
        check_int("every_n_epochs", every_n_epochs, minimum=1, optional=True)
        check_int("patience", patience, minimum=1)
        check_int("cooldown", cooldown, minimum=0)
        check_int("max_plateau_applications", max_plateau_applications, minimum=1, optional=True)
        check_int("rewarmup_steps", rewarmup_steps, minimum=0)
        if mode not in ("min", "max"):
            raise ValueError(f"mode={mode!r} is not one of ('min', 'max')")
        if not (isinstance(min_delta, (int, float)) and min_delta >= 0):
            raise ValueError(f"min_delta={min_delta!r} must be a non-negative number")
        validate_selection(scope, include, exclude)
        if normalize is not None and normalize not in NORMALIZATIONS:
            raise ValueError(f"normalize={normalize!r} is not one of {NORMALIZATIONS} or None "
                             f"(default per method: {DEFAULT_NORMALIZE})")
        if method == "polar_express" and normalize == "spectral":
            raise ValueError("normalize='spectral' is unsafe for method='polar_express'; use 'gram' or 'frobenius'")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of {tuple(_DTYPES)}")
        if tol is not None and not (isinstance(tol, (int, float)) and tol > 0):
            raise ValueError(f"tol={tol!r} must be a positive number or None")
        check_int("iters", iters, minimum=1, optional=True)
        check_int("check_every", check_every, minimum=1)
        validate_fire_options(method, scale, on_degenerate)
        if not (at_fit_start or self.epochs or every_n_epochs or self.steps or monitor):
            raise ValueError("FIREReinit has no trigger: set at_fit_start, epochs, every_n_epochs, steps or monitor")
        self.at_fit_start, self.every_n_epochs = at_fit_start, every_n_epochs
        self.monitor, self.patience, self.min_delta, self.mode = monitor, patience, float(min_delta), mode
        self.cooldown, self.max_plateau_applications = cooldown, max_plateau_applications
        self.selection = dict(scope=scope, include=list(include) if include else None,
                              exclude=list(exclude) if exclude else None, include_conv=include_conv,
                              include_head=include_head)
        self.fire_options = dict(method=method, normalize=normalize, iters=iters, tol=tol, check_every=check_every,
                                 dtype=_DTYPES[dtype], scale=scale, on_degenerate=on_degenerate,
                                 reset_optimizer=reset_optimizer)
        self.rewarmup_steps, self.log_per_layer, self.save_spectra = rewarmup_steps, log_per_layer, save_spectra
        # State that survives a resume (state_dict): which applications happened, plateau counters, warmup.
        self.applied: list[str] = []  # "fit_start", "epoch:3", "step:100", "plateau:250"
        self.history: list[dict[str, Any]] = []  # per application: key, global_step, mean DfI before/after
        self.best: float | None = None
        self.wait = 0
        self.cooldown_left = 0
        self.warmup_start: int | None = None  # global step of the first re-warmed step
        self.last_records: list[FireRecord] = []
        self._pending_logs: dict[str, float] = {}
        self._hook_handles: list = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(scope=self.selection["scope"], method=self.fire_options["method"],
                                        at_fit_start=self.at_fit_start, epochs=self.epochs,
                                        every_n_epochs=self.every_n_epochs, steps=self.steps, monitor=self.monitor)

    # ------------------------------------------------------------------------------------- hooks

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        require_full_parameters(trainer, "FIREReinit")
        require_targets(select_targets(pl_module, **self.selection), "FIREReinit", self.selection["scope"],
                        self.selection["include"], self.selection["exclude"])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.rewarmup_steps:
            self._install_rewarmup_hooks(trainer)
        if self.at_fit_start:
            self._apply_once("fit_start", trainer, pl_module)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch = trainer.current_epoch
        periodic = self.every_n_epochs is not None and epoch > 0 and epoch % self.every_n_epochs == 0
        if epoch in self.epochs or periodic:
            self._apply_once(f"epoch:{epoch}", trainer, pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step in self.steps:
            self._apply_once(f"step:{trainer.global_step}", trainer, pl_module)
        if self._pending_logs:
            for name, value in self._pending_logs.items():
                pl_module.log(name, value, on_step=True, on_epoch=False)
            self._pending_logs = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.monitor is None or trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise RuntimeError(f"FIREReinit(monitor={self.monitor!r}): metric not logged; available: "
                               f"{sorted(trainer.callback_metrics)}")
        # Ranks may log different local values: decide on the mean so every rank acts alike.
        value = float(all_reduce_mean(trainer, torch.as_tensor(value, dtype=torch.float64, device=pl_module.device)))
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.best = value if self._improved(value) else self.best
            return
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        plateau_count = sum(key.startswith("plateau:") for key in self.applied)
        limit_reached = self.max_plateau_applications is not None and plateau_count >= self.max_plateau_applications
        if self.wait >= self.patience and not limit_reached:
            if self._apply_once(f"plateau:{trainer.global_step}", trainer, pl_module):
                self.best, self.wait, self.cooldown_left = None, 0, self.cooldown

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_rewarmup_hooks()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_rewarmup_hooks()

    def state_dict(self) -> dict[str, Any]:
        return {"applied": list(self.applied), "history": list(self.history), "best": self.best, "wait": self.wait,
                "cooldown_left": self.cooldown_left, "warmup_start": self.warmup_start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_state(self, state_dict, {"applied": list, "history": list, "best": OPTIONAL_NUMBER, "wait": int,
                                       "cooldown_left": int, "warmup_start": OPTIONAL_INT})
        self.applied = list(state_dict["applied"])
        self.history = list(state_dict["history"])
        self.best, self.wait = state_dict["best"], state_dict["wait"]
        self.cooldown_left, self.warmup_start = state_dict["cooldown_left"], state_dict["warmup_start"]

    # ----------------------------------------------------------------------------------- actions

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def _apply_once(self, key: str, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        if key in self.applied:
            return False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = apply_fire(pl_module, trainer.optimizers, record_spectra=self.save_spectra, **self.selection,
                                 **self.fire_options)
        for warning in caught:  # all-zero weights (fresh zero-initialized projections) are summed up below
            if not any(r.skipped == "zero" and r.name in str(warning.message) for r in records):
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        self.applied.append(key)
        self.last_records = records
        if self.rewarmup_steps:
            self.warmup_start = trainer.global_step
        done = [r for r in records if r.skipped is None]
        seconds = sum(r.seconds for r in records)
        seconds = float(all_reduce_mean(trainer, torch.tensor(seconds, dtype=torch.float64, device=pl_module.device)))
        summary = {
            "fire/dfi_before": _mean(r.dfi_before for r in done), "fire/dfi_after": _mean(r.dfi_after for r in done),
            "fire/sfe": sum(r.sfe for r in done), "fire/sfe_normalized": _mean(r.sfe_normalized for r in done),
            "fire/seconds": seconds, "fire/applications": float(len(self.applied)),
            "fire/layers": float(len(done)),
        }
        if self.log_per_layer:
            for r in done:
                summary[f"fire/dfi_before/{r.name}"] = r.dfi_before
                summary[f"fire/dfi_after/{r.name}"] = r.dfi_after
                summary[f"fire/sfe/{r.name}"] = r.sfe
        self._pending_logs.update(summary)
        self.history.append({"key": key, "global_step": trainer.global_step, "dfi_before": summary["fire/dfi_before"],
                             "dfi_after": summary["fire/dfi_after"], "layers": len(done)})
        if not done:  # never a silent no-op: every selected weight was zero, non-finite or 1-D
            rank_zero_warn(f"FIREReinit[{key}]: no weight was orthogonalized{_skipped_summary(records)}. "
                           "Check the selection (scope/include/exclude) or the weights themselves.")
        rank_zero_info(f"FIREReinit[{key}]: {len(done)} weights orthogonalized at step {trainer.global_step} in "
                       f"{seconds:.3f}s, mean DfI {summary['fire/dfi_before']:.3g} -> {summary['fire/dfi_after']:.3g}"
                       + _skipped_summary(records))
        if self.save_spectra and done:
            self._save_spectra(trainer, key, done)
        return True

    def _save_spectra(self, trainer: L.Trainer, key: str, records: list[FireRecord]) -> None:
        from ..core.figures import save_figure

        fig = spectra_figure(records, f"FIRE at {key}: singular values of each treated weight")
        save_figure(fig, trainer, f"fire_spectra_{key.replace(':', '_')}")

    # ------------------------------------------------------------------------------ LR re-warmup

    def _warmup_factor(self, global_step: int) -> float:
        if self.warmup_start is None:
            return 1.0
        offset = global_step - self.warmup_start
        return (offset + 1) / self.rewarmup_steps if 0 <= offset < self.rewarmup_steps else 1.0

    def _install_rewarmup_hooks(self, trainer: L.Trainer) -> None:
        self._remove_rewarmup_hooks()
        for optimizer in leaf_optimizers(trainer.optimizers):
            saved: list[float] = []

            def scale_lr(opt, args, kwargs, saved=saved):
                factor = self._warmup_factor(trainer.global_step)
                saved[:] = [group["lr"] for group in opt.param_groups]
                if factor != 1.0:
                    for group in opt.param_groups:
                        group["lr"] = group["lr"] * factor

            def restore_lr(opt, args, kwargs, saved=saved):
                for group, lr in zip(opt.param_groups, saved):
                    group["lr"] = lr  # exact value back, before any scheduler reads or writes it

            self._hook_handles += [optimizer.register_step_pre_hook(scale_lr),
                                   optimizer.register_step_post_hook(restore_lr)]

    def _remove_rewarmup_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def _skipped_summary(records: list[FireRecord]) -> str:
    """``; left 8 weights unchanged: 8 all zero (model.blocks.0.attn.c_proj.weight, ...)``, or nothing."""
    by_reason: dict[str, list[str]] = {}
    for r in records:
        if r.skipped is not None:
            by_reason.setdefault(r.skipped, []).append(r.name)
    if not by_reason:
        return ""
    reasons = {"zero": "all zero", "non-finite": "with NaN/Inf"}
    parts = [f"{len(names)} {reasons.get(reason, reason)} ({names[0]}{', ...' if len(names) > 1 else ''})"
             for reason, names in by_reason.items()]
    return f"; left {sum(map(len, by_reason.values()))} weights unchanged: {', '.join(parts)}"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def spectra_figure(records: list[FireRecord], title: str):
    """Singular values before (solid) and after (dashed) FIRE: one panel per kind of weight
    (``attn.c_q``, ``mlp.c_fc``, ...), one colour per block from a colormap with its colorbar,
    so that a deep model stays readable.

    Args:
        records: what :func:`apply_fire` returned with ``record_spectra=True`` (treated weights).
        title: the figure's title.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state), ready for ``save_figure``.
    """
    import math

    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    kinds: dict[str, list[tuple[int, FireRecord]]] = {}
    for record in records:
        depth, kind = _block_and_kind(record.name)
        kinds.setdefault(kind, []).append((depth, record))
    depths = [d for members in kinds.values() for d, _ in members] or [0]
    colour, norm = colormaps["viridis"], Normalize(min(depths), max(max(depths), min(depths) + 1))
    columns = min(3, max(1, len(kinds)))
    rows = max(1, math.ceil(len(kinds) / columns))
    fig = Figure(figsize=(3.6 * columns + 1.6, 2.8 * rows + 0.8), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False, sharey=True)
    for ax, (kind, members) in zip(axes.flat, kinds.items()):
        for depth, record in members:
            c = colour(norm(depth))
            ax.plot(record.spectrum_before.flatten().sort(descending=True).values, color=c, lw=1.2)
            ax.plot(record.spectrum_after.flatten().sort(descending=True).values, color=c, lw=1.2, ls="--")
        ax.set(title=kind, yscale="log")
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(kinds):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("singular value index (largest first)")
    for ax in axes[:, 0]:
        ax.set_ylabel("singular value")
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=colour), ax=axes, label="block index (depth)", shrink=0.8)
    bar.set_ticks(sorted(set(depths)) if len(set(depths)) <= 12 else bar.get_ticks())
    fig.legend([Line2D([], [], color="0.3"), Line2D([], [], color="0.3", ls="--")], ["before", "after"],
               loc="outside upper right", ncols=2, frameon=False)
    fig.suptitle(title, x=0.02, ha="left")
    return fig


def _block_and_kind(name: str) -> tuple[int, str]:
    """``model.blocks.3.attn.c_q.weight`` -> (3, ``attn.c_q``): the first index in the name and the rest."""
    parts = name.removesuffix(".weight").split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        return 0, ".".join(parts)
    return int(parts[index]), ".".join(parts[index + 1:]) or ".".join(parts[:index])
