"""``FIREReinit``: Frobenius-isometry reinitialization (FIRE) at chosen moments of training."""
from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..ops.fire import FIRE_THROUGH, apply_fire
from ..arguments import build_options, check_bool, check_int
from .state import OPTIONAL_INT
from ..distributed.strategy import all_reduce_mean
from ..model_map import Selection, refuse_unknown_splits, select_targets
from ..ops.optimizer_state import leaf_optimizers
from .schedule import Schedule
from ..functional.isometry import FIREOptions, FireRecord
from .base import PlasticityCallback


class FIREReinit(PlasticityCallback):
    """Replace the selected weights by ``scale · polar(W)``, the nearest isometry, and reset their optimizer state.

    When: ``schedule`` (default: once at fit start, in ``on_train_start``); the hooks are
    :class:`~callbacks.base.PlasticityCallback`'s, so step triggers act in
    ``on_train_batch_start`` (the new step already trains the new weights). Each trigger acts once,
    also across a resume.

    What changes: the target weights (see :func:`plasticity_callbacks.ops.fire.apply_fire`) and the
    optimizer state of exactly those weights (``options.reset_optimizer``). A weight under weight norm or spectral
    norm is orthogonalized as the forward computes it and written through the parametrization; an orthogonal one
    is skipped, named in a warning (:data:`~plasticity_callbacks.ops.fire.FIRE_THROUGH`). With ``rewarmup_steps = K`` the
    learning rate of the next K optimizer steps is multiplied by ``(i+1)/K``: a pre-step hook on
    each optimizer scales every group's ``lr`` and a post-step hook restores it, before any LR
    scheduler steps, so the user's scheduler is neither replaced nor disturbed.
    Logged (at the next training batch): ``fire/dfi_before``, ``fire/dfi_after`` (mean over layers),
    ``fire/sfe``, ``fire/sfe_normalized``, ``fire/seconds`` (rank mean), ``fire/applications``,
    ``fire/layers``, and per layer with ``log_per_layer``. ``save_spectra`` saves singular-value
    spectra before/after as a figure in the logger's directory.
    Every rank computes the same deterministic result; under FSDP2 (``ModelParallelStrategy``) each rank
    writes its own rows of the polar factor from ``G^{-1/2}``, which the block's owner rank (round robin over
    the ranks) computes from the Gram matrix summed there; a wide block goes there by columns
    (:mod:`~distributed.sharded_fire`).

    Args:
        schedule: when to act (a Schedule or a mapping of its fields); None: ``Schedule(at_fit_start=True)``.
        options: how to orthogonalize and rescale (:class:`~functional.isometry.FIREOptions`
            or a mapping of its fields); None: its defaults (the exact polar factor by the fastest method, ``√(d_out/d_in)``).
        selection: which weights (:class:`~model_map.Selection` or a mapping of
            its fields); None: every weight but the output head, conv kernels included (one polar
            factor per spatial tap).
        rewarmup_steps: re-warm the learning rate linearly over this many steps after each application.
        log_per_layer: also log DfI and SFE per weight.
        save_spectra: save a figure of the singular values before/after each application.

    Raises:
        ValueError: a bad argument (naming it and the allowed values); at setup, a selection that finds no
            weight, or a fused Q/K/V matrix whose rows the model map cannot read (with the declarations that fit).
        MisconfigurationException: at setup, under FSDP1 or DeepSpeed (flat shards), with the fix.

    Example:
        >>> fire = FIREReinit(options=FIREOptions(method="svd"), selection=Selection(scope="mlp"))
        >>> trainer = L.Trainer(callbacks=[fire], max_steps=1000)
        >>> trainer.fit(model, datamodule=next_phase_data)
    """

    supports_fsdp2 = True  # FSDP2 shards: distributed.sharded_fire
    acts_through = FIRE_THROUGH  # weight norm, spectral norm; orthogonal: already an isometry
    quick_settings = {"schedule": {"at_fit_start": True, "steps": [2]}, "selection": {"include_conv": True}}
    summary_metrics = ("fire/dfi_before", "fire/dfi_after")
    extra_state_types = {"history": list, "warmup_start": OPTIONAL_INT}

    def __init__(
        self,
        schedule: Schedule | Mapping | None = None,
        options: FIREOptions | Mapping | None = None,
        selection: Selection | Mapping | None = None,
        rewarmup_steps: int = 0,
        log_per_layer: bool = False,
        save_spectra: bool = False,
    ):
        super().__init__(schedule, Selection.build(selection, "FIREReinit"))
        self.options = FIREOptions() if options is None else build_options(FIREOptions, options, "FIREReinit",
                                                                             "options")
        check_int("rewarmup_steps", rewarmup_steps, minimum=0)
        check_bool("log_per_layer", log_per_layer)
        check_bool("save_spectra", save_spectra)
        self.rewarmup_steps, self.log_per_layer, self.save_spectra = rewarmup_steps, log_per_layer, save_spectra
        self.history: list[dict[str, Any]] = []  # per application: reason, global_step, mean DfI before/after
        self.warmup_start: int | None = None  # global step of the first re-warmed step
        self.last_records: list[FireRecord] = []
        self._hook_handles: list = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(scope=self.selection.scope, method=self.options.method,
                                        schedule=self.schedule.describe())

    def check_targets(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Also refuse, at setup, a fused matrix whose Q/K/V rows the model map could not read."""
        super().check_targets(trainer, pl_module)
        refuse_unknown_splits(select_targets(pl_module, self.selection), self.owner)

    def attach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.rewarmup_steps:
            self._install_rewarmup_hooks(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_rewarmup_hooks()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_rewarmup_hooks()

    def extra_state(self) -> dict[str, Any]:
        return {"history": list(self.history), "warmup_start": self.warmup_start}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.history = list(state["history"])
        self.warmup_start = state["warmup_start"]

    def act(self, trainer: L.Trainer, pl_module: L.LightningModule, reason: str) -> dict[str, float]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = apply_fire(pl_module, trainer.optimizers, self.options, self.selection,
                                 record_spectra=self.save_spectra)
        for warning in caught:  # all-zero weights (fresh zero-initialized projections) are summed up below
            if not any(r.skipped == "zero" and r.name in str(warning.message) for r in records):
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        self.last_records = records
        if self.rewarmup_steps:
            self.warmup_start = trainer.global_step
        done = [r for r in records if r.skipped is None]
        seconds = sum(r.seconds for r in records)
        seconds = float(all_reduce_mean(trainer, torch.tensor(seconds, dtype=torch.float64, device=pl_module.device)))
        summary = {
            "fire/dfi_before": _mean(r.dfi_before for r in done), "fire/dfi_after": _mean(r.dfi_after for r in done),
            "fire/sfe": sum(r.sfe for r in done), "fire/sfe_normalized": _mean(r.sfe_normalized for r in done),
            "fire/seconds": seconds, "fire/applications": float(len(self.history) + 1),
            "fire/layers": float(len(done)),
        }
        if self.log_per_layer:
            for r in done:
                summary[f"fire/dfi_before/{r.name}"] = r.dfi_before
                summary[f"fire/dfi_after/{r.name}"] = r.dfi_after
                summary[f"fire/sfe/{r.name}"] = r.sfe
        self.history.append({"reason": reason, "global_step": trainer.global_step,
                             "dfi_before": summary["fire/dfi_before"], "dfi_after": summary["fire/dfi_after"],
                             "layers": len(done)})
        if not done:  # never a silent no-op: every selected weight was zero, non-finite or 1-D
            rank_zero_warn(f"FIREReinit ({reason}): no weight was orthogonalized{_skipped_summary(records)}. "
                           "Check the selection (scope/include/exclude) or the weights themselves.")
        rank_zero_info(f"FIREReinit ({reason}): {len(done)} weights orthogonalized at step {trainer.global_step} in "
                       f"{seconds:.3f}s, mean DfI {summary['fire/dfi_before']:.3g} -> {summary['fire/dfi_after']:.3g}"
                       + _skipped_summary(records))
        if self.save_spectra and done:
            name = "fit_start" if reason == "fit start" else f"step_{trainer.global_step}"
            self._save_spectra(trainer, name, done, reason)
        return summary

    def _save_spectra(self, trainer: L.Trainer, name: str, records: list[FireRecord], reason: str) -> None:
        from .figures import can_draw, save_figure

        if not can_draw("FIREReinit", "save_spectra"):
            return

        fig = spectra_figure(records, f"FIRE at {reason} (step {trainer.global_step}): singular values of each "
                                      "treated weight")
        save_figure(fig, trainer, f"fire_spectra_{name}")

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

    import textwrap

    kinds: dict[str, list[tuple[int, FireRecord]]] = {}
    containers = set()
    for record in records:
        depth, kind, container = _block_and_kind(record.name)
        kinds.setdefault(kind, []).append((depth, record))
        containers.add(container)
    depths = [d for members in kinds.values() for d, _ in members] or [0]
    colour, norm = colormaps["viridis"], Normalize(min(depths), max(max(depths), min(depths) + 1))
    columns = min(3, max(1, len(kinds)))
    rows = max(1, math.ceil(len(kinds) / columns))
    width = 3.6 * columns + 1.6
    fig = Figure(figsize=(width, 2.8 * rows + 1.2), layout="constrained")
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
    # The colour is the index in the container the name runs through: a transformer's block list, a Sequential's layer.
    container = next(iter(containers)) if len(containers) == 1 else None
    label = f"index in {container}" if container else "module index (first number in the name)"
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=colour), ax=axes, label=label, shrink=0.8)
    bar.set_ticks(sorted(set(depths)) if len(set(depths)) <= 12 else bar.get_ticks())
    # Legend below the panels, title wrapped to the figure's width: neither can run into the other.
    fig.legend([Line2D([], [], color="0.3"), Line2D([], [], color="0.3", ls="--")], ["before", "after"],
               loc="outside lower center", ncols=2, frameon=False)
    fig.suptitle(textwrap.fill(title, width=int(width * 11)), fontsize="medium")
    return fig


def _block_and_kind(name: str) -> tuple[int, str, str]:
    """``model.blocks.3.attn.c_q.weight`` -> (3, ``attn.c_q``, ``model.blocks``): the first index in the name, the
    rest (the panel), and the container before the index; ``net.2.weight`` (an ``nn.Sequential``) -> (2, ``net``,
    ``net``): one panel, a colour per layer."""
    parts = name.replace(".weight[", "[").removesuffix(".weight").split(".")  # c_attn.weight[q] -> c_attn[q]
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        return 0, ".".join(parts), ""
    container = ".".join(parts[:index])
    return int(parts[index]), ".".join(parts[index + 1:]) or container, container