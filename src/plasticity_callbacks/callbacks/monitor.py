"""``PlasticityMonitor``: the diagnostics plasticity is read from, per layer, logged while any model trains."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..arguments import build_options, check_int, check_number, refuse_unknown_fields
from ..distributed.sharded_state import copies_of, state_copy
from ..distributed.strategy import is_dtensor, rank_identical_generator
from ..functional import diagnostics as D
from ..functional.dormancy import dormancy_scores
from ..functional.isometry import target_scale
from ..model_map import HiddenUnits, Selection, check_layer_map, find_neuron_layers
from ..model_map.hidden_inputs import HiddenInputReaders
from ..model_map.patterns import matching_parameters, name_selection
from .base import PlasticityCallback
from .step_logging import log_at_step

GROUPS = ("activations", "weights", "spectra", "curvature")


@refuse_unknown_fields
@dataclass(frozen=True)
class Curvature:
    """The monitor's curvature group: the top Hessian eigenvalue of the loss on a held batch (Lyle et al. 2023),
    by power iteration; about ``2 + 2·iterations`` backward passes each time it is measured.

    Example:
        >>> PlasticityMonitor(curvature=Curvature(every_n_steps=1000, iterations=20))
        >>> PlasticityMonitor(curvature={"every_n_steps": 1000})   # a config's mapping
    """

    every_n_steps: int = 1000  # optimizer steps between two measurements
    iterations: int = 10  # power-iteration steps
    loss: Callable[[nn.Module, Any], torch.Tensor] | None = None  # f(pl_module, batch); None: training_step's

    def __post_init__(self) -> None:
        check_int("PlasticityMonitor curvature every_n_steps", self.every_n_steps)
        check_int("PlasticityMonitor curvature iterations", self.iterations)
        if self.loss is not None and not callable(self.loss):
            raise ValueError(f"PlasticityMonitor curvature loss={self.loss!r} must be f(pl_module, batch) -> loss")


class PlasticityMonitor(PlasticityCallback):
    """Logs, per layer and summarised, the diagnostics the plasticity literature reads loss of plasticity from.

    Nothing in the model changes. Each group of metrics has its own interval (optimizer steps; None turns the
    group off) and is measured over the optimizer step that ends at a multiple of it, then logged once at that
    global step (:func:`~callbacks.step_logging.log_at_step`, so ``Schedule(threshold=...)`` can act on it):

    **activations** (``activations_every_n_steps``): the inputs of every ``down`` layer the model map finds
    (:func:`~model_map.find_neuron_layers`: this package's GPT MLPs, Hugging Face MLPs, conv chains…), read by a
    forward hook during the training forward (the GPT MLPs' ``hidden_observer`` slot when free, which a
    compiled graph calls), never by a second forward; gradient-accumulation micro-batches all count.

    - ``monitor/dormant[/layer]``, ``monitor/dead[/layer]``: share of units whose ReDo score
      ``E|h_i| / mean_k E|h_k|`` is ``<= tau`` / 0 (Sokar et al. 2023; Plasticine's dormant ratio, Dohare
      et al. 2024's dead units).
    - ``monitor/feature_erank[/layer]``, ``monitor/feature_srank[/layer]``: effective rank
      ``exp(H(σ/Σσ))`` (Roy & Vetterli; Kumar et al. 2021; Lyle et al. 2023) and stable rank ``Σσ²/σ²_max``
      (Plasticine) of the features ``Φ`` (samples·positions × units) of the ``feature_layers``.

    **weights** (``weights_every_n_steps``), over the trainable parameters ``selection`` matches (per matrix,
    and all together):

    - ``monitor/weight_norm``: ``‖θ‖`` (Dohare et al. 2024; Plasticine's weight magnitude);
    - ``monitor/weight_distance``: ``‖θ − θ₀‖ / ‖θ₀‖`` from the weights at the start of the first fit
      (Plasticine's weight drift; Lyle et al. 2023); θ₀ is kept in ``state_dict`` (a copy of the weights);
      a weight initialized to zero has no relative drift and is not logged (a gap, never a NaN);
    - ``monitor/grad_norm``: ``‖∇θ‖`` before clipping (Plasticine's gradient norm);
    - ``monitor/update_ratio``: ``‖Δθ‖ / ‖θ‖`` of this step's update (a copy of the weights for one step).

    **spectra** (``spectra_every_n_steps``), per matrix (``≥ 2``-D, read as ``(dim 0, the rest)``):
    ``monitor/weight_srank[/matrix]`` (stable rank ``‖W‖²_F / ‖W‖²₂``, Plasticine) and ``monitor/weight_dfi[/matrix]``
    (FIRE's deviation from isometry ``‖WᵀW − s²I‖²_F`` at ``s = √(d_out/d_in)``, Chung et al. 2025), from one
    Gram matrix each: ``O(m·n·min(m, n))``.

    **curvature** (``curvature``, a :class:`Curvature`; off by default): ``monitor/curvature``, the top Hessian
    eigenvalue (Lyle et al. 2023) of the loss on a held batch (the fit's first training batch), by
    ``curvature.iterations`` power-iteration steps; costs about ``2 + 2·iterations`` backward
    passes (a double-backward graph kept meanwhile). The loss is ``curvature.loss(pl_module, batch)``, or
    ``training_step``'s ``loss`` with its own ``self.log`` calls muted. Runs eagerly under ``torch.compile``.

    **Distributed**: DDP and FSDP2 (``ModelParallelStrategy``) log one process's values on the union of the
    ranks' batches: activation sums and Gram matrices are summed over ranks (the strategy's ``reduce``);
    FSDP2 shards' squared sums and Gram matrices are summed over the shards, never a gathered weight. The
    curvature averages each Hessian-vector product over DDP ranks, and is refused under FSDP2.

    At the end of training, ``plot=True`` draws ``figures/plasticity_monitor.png`` (one panel per metric,
    steps on x, one line per layer, the summary in black).

    Args:
        activations_every_n_steps: interval of the activation group (None: off).
        weights_every_n_steps: interval of the weight group (None: off).
        spectra_every_n_steps: interval of the weight-spectrum group (None: off).
        curvature: the curvature group's interval, iterations and loss (a :class:`Curvature` or a mapping of its
            fields); None: off.
        tau: dormancy threshold (ReDo: 0.025).
        feature_layers: ``fnmatch`` patterns on neuron-layer names whose feature rank is measured;
            ``("last",)``: the last layer found (the penultimate features of Kumar et al.).
        selection: name patterns of the parameters in the weight and spectrum groups (a Selection or a
            mapping with ``include``/``exclude``); None: every trainable parameter.
        per_layer: also log each layer's / matrix's value (the summaries always).
        layer_map: neuron layers by module names, as ``ReDoMonitor``'s; None: found by the model map.
        plot: draw the figure at the end of training.

    Example:
        >>> monitor = PlasticityMonitor(activations_every_n_steps=100, spectra_every_n_steps=500)
        >>> trainer = L.Trainer(callbacks=[monitor], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # logs monitor/dormant, monitor/feature_erank, monitor/weight_srank, …
    """

    summary_metrics = ("monitor/dormant", "monitor/feature_erank", "monitor/weight_srank", "monitor/grad_norm")
    supports_fsdp2 = True
    every_step_hook = "on_train_batch_end"  # measures at batch ends
    quick_settings = {"activations_every_n_steps": 1, "weights_every_n_steps": 1, "spectra_every_n_steps": 1}
    reads_gradients = True  # the gradient norm: a NaN gradient skips the measurement too (the base's rule)
    default_schedule = None  # the monitor never acts
    step_hook = "on_train_batch_end"
    extra_state_types = {"names": list, "initial": list, "history": list}
    parameter_state_keys = ("initial",)

    def __init__(self, activations_every_n_steps: int | None = 100, weights_every_n_steps: int | None = 100,
                 spectra_every_n_steps: int | None = 500, curvature: Curvature | Mapping | None = None,
                 tau: float = 0.025, feature_layers: Sequence[str] = ("last",),
                 selection: Selection | Mapping | None = None, per_layer: bool = True,
                 layer_map: Mapping | None = None, plot: bool = True):
        if curvature is not None:
            curvature = build_options(Curvature, curvature, "PlasticityMonitor", "curvature")
        curvature_every_n_steps = None if curvature is None else curvature.every_n_steps
        curvature_iterations, curvature_loss = (10, None) if curvature is None else (curvature.iterations, curvature.loss)
        intervals = (activations_every_n_steps, weights_every_n_steps, spectra_every_n_steps, curvature_every_n_steps)
        for group, every in zip(GROUPS, intervals):
            check_int(f"PlasticityMonitor {group}_every_n_steps", every, optional=True)
        if all(every is None for every in intervals):
            raise ValueError("PlasticityMonitor measures nothing: every *_every_n_steps and curvature are None; set one")
        check_number("PlasticityMonitor tau", tau, 0.0, 1.0, "(ReDo: 0.025)")
        if isinstance(feature_layers, str) or not all(isinstance(p, str) for p in feature_layers):
            raise ValueError(f"PlasticityMonitor feature_layers={feature_layers!r} must be a list of patterns, "
                             "e.g. ['last'] or ['*mlp*']")
        for name, flag in (("per_layer", per_layer), ("plot", plot)):
            if not isinstance(flag, bool):
                raise ValueError(f"PlasticityMonitor {name}={flag!r} must be true or false")
        super().__init__(selection=name_selection(selection, "PlasticityMonitor"))
        self.every = dict(zip(GROUPS, intervals))
        self.tau, self.feature_patterns, self.per_layer, self.plot = float(tau), list(feature_layers), per_layer, plot
        self.layer_map, self.curvature_iterations = check_layer_map(layer_map, "PlasticityMonitor"), curvature_iterations
        self.curvature_loss = curvature_loss
        self.layers: list[HiddenUnits] = []
        self.feature_layers: list[int] = []  # indices into self.layers
        self.names: list[str] = []  # the chosen parameters
        self.initial: list[torch.Tensor] = []  # θ₀, placed like the parameters
        self.history: list[dict[str, float]] = []  # {"step": s, metric: value, ...} per measuring step
        self._params: list[torch.Tensor] = []
        self._readers = HiddenInputReaders()  # the collectors fed with down's input
        self._step: int | None = None  # the global step at the start of the optimizer step being measured
        self._due: dict[str, bool] = {}
        self._collecting = self._seen = False
        self._sums = self._counts = self._grams = None
        self._grad_squares: torch.Tensor | None = None
        self._before: list[torch.Tensor] | None = None
        self._held_batch = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(include=self.selection.include, exclude=self.selection.exclude)

    # ------------------------------------------------------------------ setup
    def check_strategy(self, trainer) -> None:
        super().check_strategy(trainer)  # FSDP2 (supports_fsdp2): shard sums, reduced
        if self.every["curvature"] and "ModelParallel" in type(trainer.strategy).__name__:
            raise ValueError("PlasticityMonitor curvature: the Hessian-vector products need a "
                             "double backward through the whole model, which FSDP2 does not run; set "
                             "curvature=None under FSDP2 or measure it with strategy='ddp'")

    def check_targets(self, trainer, pl_module) -> None:
        matching_parameters(pl_module, self.selection, self.owner)  # none: fails before any training
        if not self.every["activations"]:
            return
        self.layers = find_neuron_layers(pl_module, self.layer_map, owner=self.owner)
        if not self.layers:
            raise ValueError("PlasticityMonitor found no neuron layers for its activation metrics (dormant units, "
                             "feature rank); pass layer_map={name: (up_or_[gate, up], down)}, "
                             "declare_plasticity(model, neurons=...), or activations_every_n_steps=None")
        names = [layer.name for layer in self.layers]
        chosen_features = [i for i, name in enumerate(names)
                           if any(fnmatch(name, p) for p in self.feature_patterns if p != "last")]
        if "last" in self.feature_patterns:
            chosen_features.append(len(names) - 1)
        self.feature_layers = sorted(set(chosen_features))
        if not self.feature_layers:
            raise ValueError(f"PlasticityMonitor feature_layers={self.feature_patterns} match none of the neuron "
                             f"layers {names}")

    def on_fit_start(self, trainer, pl_module) -> None:
        self._attach_weights(trainer, pl_module)
        self._remove_hooks()
        if self.layers:
            self._attach_collectors(pl_module)
        rank_zero_info(f"PlasticityMonitor watches {len(self.layers)} neuron layers and {len(self._params)} "
                       f"parameters every {({k: v for k, v in self.every.items() if v})} steps")

    def on_train_start(self, trainer, pl_module) -> None:
        self._attach_weights(trainer, pl_module)  # FSDP2 restores a checkpoint after on_fit_start
        super().on_train_start(trainer, pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._remove_hooks()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()

    def _attach_weights(self, trainer, pl_module) -> None:
        """θ₀ paired with the chosen parameters: taken now on a first fit, else the checkpoint's. The parameters
        are looked up again here: FSDP2's ``configure_model`` replaces them with sharded ones after ``setup``."""
        chosen = matching_parameters(pl_module, self.selection, self.owner)
        self.names, self.initial, self._params = copies_of(trainer, chosen, self.names, self.initial,
                                                           "PlasticityMonitor initial weights")

    def _attach_collectors(self, pl_module) -> None:
        by_down: dict[int, list[int]] = {}  # id(down) -> the layers reading slices of its input
        for index, layer in enumerate(self.layers):
            by_down.setdefault(id(layer.down), []).append(index)
        self._readers.reset(pl_module)
        for indices in by_down.values():
            self._readers.read(self.layers[indices[0]].down, _Collector(self, indices))

    def _remove_hooks(self) -> None:
        self._readers.remove()
        self._collecting = False

    # ------------------------------------------------------------------ measuring
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self._step != step:  # the first micro-batch of an optimizer step
            self._step = step
            self._due = {g: bool(e) and (step + 1) % e == 0 for g, e in self.every.items()}
            self._reset_sums(pl_module)
        if self._held_batch is None and self.every["curvature"]:
            self._held_batch = _detached(batch)
        self._collecting, self._seen = self._due.get("activations", False), False
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def _reset_sums(self, pl_module) -> None:
        device = pl_module.device
        self._grad_squares, self._before = None, None
        if not self._due["activations"]:
            return
        self._sums = [torch.zeros(layer.width, dtype=torch.float64, device=device) for layer in self.layers]
        self._counts = torch.zeros(len(self.layers), dtype=torch.float64, device=device)
        self._grams = {i: torch.zeros(self.layers[i].width, self.layers[i].width, dtype=torch.float64, device=device)
                       for i in self.feature_layers}

    @torch.no_grad()
    def _collect(self, module: nn.Module, h: torch.Tensor, indices: list[int]) -> None:
        if not (self._collecting and module.training):  # another callback's evaluation forward inside the step
            return
        for index in indices:
            units, unit_dim = self.layers[index].unit_activity(h.detach())
            self._sums[index] += D.abs_activation_sum(units, unit_dim)
            self._counts[index] += units.numel() // units.shape[unit_dim]
            if index in self._grams:
                self._grams[index] += D.feature_gram(units, unit_dim)
        self._seen = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if not self._due.get("weights") or self._grad_squares is not None:  # several optimizers: the first call
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        self._grad_squares = torch.stack([_local(g).float().square().sum().double() for g in grads])
        self._before = [_local(p).detach().clone() for p in self._params]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._collecting and not self._seen and pl_module.training:
            raise RuntimeError(
                "PlasticityMonitor saw no activations in a measuring training step: its forward hooks were not "
                "called, which happens when the model was compiled (torch.compile) before they were added. Attach "
                "the monitor before the first compiled forward, give the blocks a hidden_observer slot (see "
                "models/blocks/mlp.py), or set activations_every_n_steps=None.")
        self._collecting = False
        if trainer.global_step == self._step or not any(self._due.values()):  # no optimizer step ended here
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if self.skip_nonfinite(trainer, pl_module, "the measurement"):  # the base's rule: no NaN metric logged
            self._due = {}
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        metrics = {}
        if self._due["activations"]:
            metrics |= self._activation_metrics(trainer)
        if self._due["weights"]:
            metrics |= self._weight_metrics()
        if self._due["spectra"]:
            metrics |= self._spectrum_metrics()
        if self._due["curvature"]:
            metrics |= {"monitor/curvature": self._curvature(trainer, pl_module)}
        self._due = {}
        names = list(metrics)
        values = dict(zip(names, torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(())
                                              .to(pl_module.device) for v in metrics.values()]).tolist()))
        # A ratio over a weight initialized to zero has no value (NaN from norm_ratio): it is left out, a gap in the
        # curve, so no NaN is ever logged (the base's rule; the weights themselves were checked finite above).
        values = {name: value for name, value in values.items() if math.isfinite(value)}
        log_at_step(trainer, values)  # measured at this step only: one row, at this step
        self.history.append({"step": trainer.global_step, **values})
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _activation_metrics(self, trainer) -> dict[str, torch.Tensor]:
        packed = torch.cat([*self._sums, self._counts, *(g.reshape(-1) for g in self._grams.values())])
        if trainer.world_size > 1:  # every rank's batch: the sums of one process over their union
            packed = trainer.strategy.reduce(packed, reduce_op="sum")
        widths = [layer.width for layer in self.layers]
        parts = packed.split([*widths, len(widths), *(w * w for w in (self.layers[i].width for i in self._grams))])
        sums, counts, grams = parts[:len(widths)], parts[len(widths)], parts[len(widths) + 1:]
        scores = [dormancy_scores(s / c.clamp_min(1)) for s, c in zip(sums, counts)]
        metrics = {f"monitor/{k}": v for k, v in D.unit_fractions(torch.cat(scores), self.tau).items()}
        ranks = {i: D.gram_ranks(g.view(self.layers[i].width, -1)) for i, g in zip(self._grams, grams)}
        metrics["monitor/feature_erank"] = torch.stack([r["effective_rank"] for r in ranks.values()]).mean()
        metrics["monitor/feature_srank"] = torch.stack([r["stable_rank"] for r in ranks.values()]).mean()
        if self.per_layer:
            for layer, s in zip(self.layers, scores):
                for key, value in D.unit_fractions(s, self.tau).items():
                    metrics[f"monitor/{key}/{layer.name}"] = value
            for i, r in ranks.items():
                metrics[f"monitor/feature_erank/{self.layers[i].name}"] = r["effective_rank"]
                metrics[f"monitor/feature_srank/{self.layers[i].name}"] = r["stable_rank"]
        return metrics

    def _weight_metrics(self) -> dict[str, torch.Tensor]:
        params = self._params
        device = self._params[0].device
        before = self._before or [_local(p).detach() for p in params]  # no optimizer step seen: Δθ = 0
        grad_squares = (self._grad_squares if self._grad_squares is not None
                        else torch.zeros(len(params), dtype=torch.float64, device=device))
        # one row per parameter (this rank's shard under FSDP2): ‖θ‖², ‖θ − θ₀‖², ‖θ₀‖², ‖Δθ‖², ‖θ before‖², ‖∇θ‖²
        squares = torch.stack([
            torch.stack([D.squared_sum([_local(p)]), D.squared_difference_sum([_local(p)], [_local(p0)]),
                         D.squared_sum([_local(p0)]), D.squared_difference_sum([_local(p)], [b]), D.squared_sum([b]),
                         g.to(device)])
            for p, p0, b, g in zip(params, self.initial, before, grad_squares)])
        squares = _sum_over_shards(squares, params)
        self._before = None
        total = squares.sum(0)
        metrics = {"monitor/weight_norm": total[0].sqrt(), "monitor/weight_distance": D.norm_ratio(total[1], total[2]),
                   "monitor/update_ratio": D.norm_ratio(total[3], total[4]), "monitor/grad_norm": total[5].sqrt()}
        if self.per_layer:
            for name, p, row in zip(self.names, params, squares):
                if p.dim() >= 2:
                    metrics[f"monitor/weight_norm/{name}"] = row[0].sqrt()
                    metrics[f"monitor/weight_distance/{name}"] = D.norm_ratio(row[1], row[2])
                    metrics[f"monitor/update_ratio/{name}"] = D.norm_ratio(row[3], row[4])
                    metrics[f"monitor/grad_norm/{name}"] = row[5].sqrt()
        return metrics

    def _spectrum_metrics(self) -> dict[str, torch.Tensor]:
        matrices = [(name, p) for name, p in zip(self.names, self._params) if p.dim() >= 2]
        grams = []
        for _, p in matrices:
            W = _local(p).detach().reshape(_local(p).shape[0], -1)
            wide = not is_dtensor(p) and W.shape[0] < W.shape[1]  # whole: the smaller Gram matrix
            grams.append(D.column_gram(W.mT if wide else W))
        grams = _sum_grams_over_shards(grams, [p for _, p in matrices])
        metrics, sranks, dfis = {}, [], []
        for (name, p), gram in zip(matrices, grams):
            rows, cols = p.shape[0], math.prod(p.shape[1:])
            srank = D.gram_ranks(gram)["stable_rank"]
            dfi = D.gram_isometry_deviation(gram, cols if gram.shape[0] == rows else rows,
                                            target_scale(p, "sqrt_dout_din"))
            sranks.append(srank)
            dfis.append(dfi)
            if self.per_layer:
                metrics[f"monitor/weight_srank/{name}"], metrics[f"monitor/weight_dfi/{name}"] = srank, dfi
        if sranks:
            metrics["monitor/weight_srank"] = torch.stack(sranks).mean()
            metrics["monitor/weight_dfi"] = torch.stack(dfis).mean()
        return metrics

    def _curvature(self, trainer, pl_module) -> torch.Tensor:
        batch = _to_device(self._held_batch, pl_module.device)

        def loss():
            if self.curvature_loss is not None:
                return self.curvature_loss(pl_module, batch)
            with _muted_logging(pl_module):
                out = pl_module.training_step(batch, 0)
            return out["loss"] if isinstance(out, Mapping) else out

        def average(hv):  # the Hessian of the ranks' mean loss
            return trainer.strategy.reduce(hv, reduce_op="mean") if trainer.world_size > 1 else hv

        was_training = pl_module.training
        pl_module.eval()  # no dropout: the same function at every product
        try:
            # compiled graphs and fused attention kernels have no double backward: eager, math attention
            with torch.compiler.set_stance("force_eager"), sdpa_kernel(SDPBackend.MATH):
                return D.top_hessian_eigenvalue(loss, list(pl_module.parameters()), self.curvature_iterations,
                                                rank_identical_generator(0, trainer.global_step), average)
        finally:
            pl_module.train(was_training)

    # ------------------------------------------------------------------ figure
    def on_train_end(self, trainer, pl_module) -> None:
        from .figures import can_draw, new_figure, save_figure

        if not self.plot or not self.history or trainer.global_rank != 0 or not can_draw(self.owner, "plot"):
            return
        summaries = sorted({k for row in self.history for k in row if k.count("/") == 1})
        fig = new_figure(figsize=(10, 2.2 * ((len(summaries) + 1) // 2)))
        axes = fig.subplots((len(summaries) + 1) // 2, 2, squeeze=False).reshape(-1)
        for ax, summary in zip(axes, summaries):
            layers = sorted({k for row in self.history for k in row if k.startswith(summary + "/")})
            for key in layers:
                steps, values = _series(self.history, key)
                ax.plot(steps, values, linewidth=0.8, alpha=0.7, label=key[len(summary) + 1:].removesuffix(".weight"))
            steps, values = _series(self.history, summary)
            ax.plot(steps, values, color="black", linewidth=2, label="all")
            ax.set_title(summary, fontsize=9)
            ax.tick_params(labelsize=7)
            if len(layers) <= 8:  # more lines than that: a legend would hide the curves
                ax.legend(fontsize=5, ncol=2)
        for ax in axes[len(summaries):]:
            ax.axis("off")
        axes[len(summaries) - 1].set_xlabel("global step")
        fig.tight_layout()
        save_figure(fig, trainer, "plasticity_monitor")

    # ------------------------------------------------------------------ resume
    def extra_state(self) -> dict:
        return {"names": list(self.names), "initial": [state_copy(p) for p in self.initial],
                "history": [dict(row) for row in self.history]}

    def load_extra_state(self, state: dict) -> None:
        self.names, self.initial = list(state["names"]), list(state["initial"])
        self.history = [dict(row) for row in state["history"]]


class _Collector:
    """Hands one ``down`` layer's input to the monitor; a plain object kept for the fit (a compiled graph
    guards on it)."""

    def __init__(self, monitor: PlasticityMonitor, indices: list[int]):
        self.monitor, self.indices = monitor, indices

    def __call__(self, module: nn.Module, h: torch.Tensor) -> None:
        self.monitor._collect(module, h, self.indices)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 ``DTensor``, else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _sum_over_shards(rows: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Add the rows of FSDP2-sharded parameters over their shards (one all-reduce); others are whole already."""
    sharded = [i for i, p in enumerate(params) if is_dtensor(p)]
    if not sharded:
        return rows
    import torch.distributed as dist

    part = rows[sharded].contiguous()
    dist.all_reduce(part, group=params[sharded[0]].device_mesh.get_group())
    rows = rows.clone()
    rows[sharded] = part
    return rows


def _sum_grams_over_shards(grams: list[torch.Tensor], params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    sharded = [i for i, p in enumerate(params) if is_dtensor(p)]
    if not sharded:
        return grams
    import torch.distributed as dist

    packed = torch.cat([grams[i].reshape(-1) for i in sharded])
    dist.all_reduce(packed, group=params[sharded[0]].device_mesh.get_group())
    grams = list(grams)
    for i, part in zip(sharded, packed.split([grams[i].numel() for i in sharded])):
        grams[i] = part.view_as(grams[i])
    return grams


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    rows = [row for row in history if key in row]
    return [row["step"] for row in rows], [row[key] for row in rows]


def _detached(batch):
    if torch.is_tensor(batch):
        return batch.detach().clone()
    if isinstance(batch, Mapping):
        return {k: _detached(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_detached(v) for v in batch)
    return batch


def _to_device(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


@contextmanager
def _muted_logging(module):
    """``module.log``/``log_dict`` do nothing inside: a ``training_step`` replayed for the curvature must not
    overwrite the step's logged loss."""
    module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.log, module.log_dict
