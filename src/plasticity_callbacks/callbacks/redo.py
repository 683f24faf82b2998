"""``ReDoMonitor``: watch dormant neurons during training and optionally recycle them (ReDo)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..arguments import check_bool, check_int, check_number
from ..errors import CheckpointError
from ..distributed.strategy import all_reduce_mean, rank_identical_generator
from ..model_map import HiddenUnits, Selection, check_layer_map, find_neuron_layers
from ..model_map.experts import ExpertMatrix, expert_hidden
from ..model_map.hidden_inputs import HiddenInputReaders
from ..model_map.neurons import candidates_hint
from ..ops.redo import recycle_
from .schedule import Schedule
from .step_logging import log_at_step
from ..functional.dormancy import INITS, dormancy_scores, dormant_mask, finite_std, mean_abs_activation
from .base import PlasticityCallback

CALLBACK_INITS = ("init_std", "model", *INITS)


class ReDoMonitor(PlasticityCallback):
    """Dormant-neuron statistics, logging and (optionally) recycling, after Sokar et al. (ICML 2023).

    **Finds** the neuron layers through the model map
    (:func:`plasticity_callbacks.model_map.find_neuron_layers`): our GPT's MLPs, Hugging Face
    MLPs (Llama gate/up/down, GPT-2 ``c_fc``/``c_proj``, BERT intermediate/output, GPT-J ``fc_in``/``fc_out``),
    litgpt's ``fc_1``/``fc_2``/``proj``, fused inputs whose pairing the forward shows (Phi-3 ``gate_up_proj``,
    ModernBERT ``Wi``), torch ``TransformerEncoderLayer``, ``Linear/conv/transposed conv → [BatchNorm] →
    activation → [pool/flatten] → Linear/conv`` chains (ResNet blocks, conv→flatten→linear, decoders),
    declared layouts, or an explicit ``layer_map``; and each expert of a mixture-of-experts stack
    (transformers 5.x ``experts.gate_up_proj``/``down_proj``, ``(out, in)`` or ``(in, out)``): one layer per
    expert, named ``<experts>.<e>``, measured on the tokens routed to it and recycled in that expert's slices
    of the stacks; and, for any other names, ``up -> [gate] -> activation -> down`` read from the model's own
    forward (``F.relu``, ``torch.square``, ``x * x``, ``silu(g) * u``, conv chains: Nemotron, RWKV, T5). What the
    forward shows but cannot be paired (a unit that also reaches the residual, experts stored another way) is
    named in one warning with the ``layer_map`` that declares it; state-space mixers (Mamba) and recurrent layers
    are named as not unit layers. ``selection`` picks among the layers found, as for every method. Raises a
    ValueError in ``setup`` when it finds none, naming the candidates.

    **Collects** in ``on_train_batch_start``/``on_train_batch_end`` of every
    ``collect_every_n_steps``-th training step (never in validation) the neuron values as they
    enter each ``down`` layer — ``relu(c_fc x)²`` for relu², ``act(c_gate x) * c_fc x`` for
    SwiGLU/GeGLU, the activation's output in a plain MLP/CNN — so no activation is
    re-implemented here. Blocks with a ``hidden_observer`` slot (our GPT's MLPs) hand them over
    through it, which works whether the model was compiled before or after this callback
    attached; experts are computed from their module's inputs and its own gating code (one host sync per
    MoE layer and collecting step, to list the routed experts); other layers get a forward pre-hook on
    ``down``, which a graph compiled before the
    hook existed never calls: that case raises a RuntimeError at the first collecting step
    instead of logging nothing. The mean ``|h|`` over batch and time/space updates an EMA per
    neuron (``lerp_``, weight ``1 - ema_decay``; a neuron's first observation, and its first
    after recycling, replaces the EMA). No host sync on this path; under ``torch.compile`` it
    adds two graphs, for collecting and for idle steps (the idle one runs no extra operation).

    **Logs** in ``on_train_batch_end`` every ``log_every_n_steps`` optimizer steps, once, at that
    global step (:func:`~callbacks.step_logging.log_at_step`; the trainer's own ``log_every_n_steps`` does
    not apply): ``redo/dormant[/layer]`` (fraction with score ≤ ``tau``) and ``redo/dead[/layer]`` (τ = 0).
    A neuron that stops firing counts as dead at τ = 0 only once its EMA has decayed below ~1e-8
    of the layer mean (≈ 175 collections at ``ema_decay=0.9``): a lagging indicator by design.

    **Recycles** (off unless a ``schedule`` is given) when the schedule says so: step triggers and
    task boundaries in ``on_train_batch_end`` (after the step whose statistics it uses), epoch
    triggers in ``on_train_epoch_start``, plateaus in ``on_validation_end``; each trigger once, also
    across a resume. ``neuron_reset.reinit_incoming`` (every layer first, then ``neuron_reset.zero_outgoing``,
    the reference's order) re-samples the τ-dormant neurons' incoming rows (``init="init_std"``:
    ``N(0, σ)`` with σ the layer's weight std recorded at the start of fit, i.e. its own init scale;
    ``init="model"``: rows of a fresh draw by the layer's own init code, Hugging Face
    ``_init_weights`` included), zeroes their biases,
    outgoing columns and the optimizer moments of exactly those slices, and logs
    ``redo/recycled[/layer]``. The output head's units are never recycled.

    **DDP**: the EMA is all-reduced (mean) before every log or recycle decision and written back,
    so all ranks decide alike and a checkpoint holds the global statistics; re-sampled weights come
    from a generator seeded from ``(seed, global_step, layer)`` and are identical on every rank.
    Sharded strategies are refused in ``setup``. Hooks are removed in ``on_fit_end``/``teardown``;
    EMA, counters and recorded init scales are kept in ``state_dict``.

    Args:
        tau: a neuron is dormant when its score (mean ``|h|`` over the layer's mean) is ``<= tau``.
        collect_every_n_steps: training steps whose activations update the statistics (1: every step).
        log_every_n_steps: optimizer steps between two logs of the dormant fractions.
        ema_decay: weight of the past in the per-neuron EMA, in [0, 1).
        schedule: when to recycle (a Schedule or a mapping of its fields; not at fit start, where
            there are no statistics yet); None: monitor only.
        init: how recycled rows are drawn: ``init_std`` (``N(0, σ)``, σ the layer's std at fit start),
            ``model`` (a fresh draw by the model's own init code), ``weight_std`` (σ now), ``default``
            (the layer's ``reset_parameters``) or ``xavier_uniform``.
        layer_map: ``{name: (up | [gate, up], down)}`` by module names; None: found automatically.
        selection: which layers are watched (a :class:`~model_map.Selection` or a mapping of its fields, as for
            every method): a layer whose ``up`` (and gate) weights it selects; ``scope="mlp"``, ``include`` and
            ``exclude`` patterns on parameter names. ``layer_map`` is the explicit declaration instead.
        plot_scores: save a histogram of the scores per layer at the end of training.
        seed: mixed with the global step and layer into the re-sampling generator.

    Raises:
        ValueError: a bad argument; at setup, no neuron layer found (pass ``layer_map`` or declare them).
        RuntimeError: a collecting training step saw no activation (a model compiled before the hooks); a
            recycle on weights factorized by ``AdaptiveSVDSwitch(minor_training="factorize")``.
        CheckpointError: a checkpointed state whose tensors do not fit its layers.
        MisconfigurationException: at setup, under FSDP1 or DeepSpeed (flat shards), with the fix.

    Example:
        >>> redo = ReDoMonitor(tau=0.025, schedule=Schedule(every_n_steps=1000))
        >>> trainer = L.Trainer(callbacks=[redo], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # logs redo/dormant, redo/dead, redo/recycled
    """

    supports_fsdp2 = True  # FSDP2: rows, columns of shards (distributed.sharding)
    quick_settings = {"tau": 1.0, "collect_every_n_steps": 1, "log_every_n_steps": 1,  # every unit is dormant
                      "schedule": {"every_n_steps": 2}}
    summary_metrics = ("redo/dormant",)
    default_schedule = None  # monitor only
    step_hook = "on_train_batch_end"  # after the step whose statistics it uses
    extra_state_types = {"layers": list, "widths": list, "ema": torch.Tensor, "observed": torch.Tensor,
                         "recycled": torch.Tensor, "init_std": torch.Tensor, "collections": int,
                         "last_logged_step": int}
    optional_state_types = {"nonfinite_batches": torch.Tensor}

    def __init__(
        self,
        tau: float = 0.025,
        collect_every_n_steps: int = 10,
        log_every_n_steps: int = 100,
        ema_decay: float = 0.9,
        schedule: Schedule | Mapping | None = None,
        init: str = "init_std",
        layer_map: Mapping | None = None,
        selection: Selection | Mapping | None = None,
        plot_scores: bool = False,
        seed: int = 0,
    ):
        check_number("tau", tau, 0.0, 1.0, "(0 = exactly dead; ReDo uses 0.025 or 0.1)")
        check_int("collect_every_n_steps", collect_every_n_steps)
        check_int("log_every_n_steps", log_every_n_steps)
        check_number("ema_decay", ema_decay, 0.0, 1.0, "(1 never updates the EMA)", high_open=True)
        super().__init__(schedule, Selection.build(selection, "ReDoMonitor"))
        if self.schedule is not None and self.schedule.at_fit_start:
            raise ValueError("ReDoMonitor schedule.at_fit_start=True: recycling needs statistics, and at fit start "
                             "there are none yet; use steps, every_n_steps, epochs, task boundaries or a plateau")
        if init not in CALLBACK_INITS:
            raise ValueError(f"init={init!r} is not one of {CALLBACK_INITS}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed={seed!r} must be an integer")
        self.layer_map = check_layer_map(layer_map, "ReDoMonitor")
        self.tau, self.ema_decay, self.init = float(tau), float(ema_decay), init
        self.collect_every_n_steps, self.log_every_n_steps = collect_every_n_steps, log_every_n_steps
        check_bool("plot_scores", plot_scores)
        self.plot_scores, self.seed = plot_scores, seed
        self.exclude = list(self.selection.exclude) if self.selection.exclude else None

        self.layers: list[HiddenUnits] = []
        self.collections = 0  # training batches whose activations entered the EMA
        self.last_logged_step = -1
        self._ema: torch.Tensor | None = None  # flat over layers: EMA of mean |h| per neuron
        self._observed: torch.Tensor | None = None  # per neuron: seen since fit start or its recycling
        self._recycled: torch.Tensor | None = None  # neurons recycled so far, per layer
        self._init_std: torch.Tensor | None = None  # (layers, 2): weight std of up and gate at fit start
        self._nonfinite: torch.Tensor | None = None  # per layer: collected batches skipped for NaN/Inf activations
        self._pending_state: dict | None = None
        self._readers = HiddenInputReaders()  # the collectors fed with down's input
        self._collecting = False
        self._seen = False  # a collector ran in this step (a hook that never runs is an error, not silence)
        self._warned_unobserved = False
        self._announced: str | None = None  # the "watches N layers" line last printed
        self._step_scores: dict[str, torch.Tensor] | None = None  # computed once per step for logs and recycling

    @property
    def state_key(self) -> str:
        return self._generate_state_key(tau=self.tau, collect=self.collect_every_n_steps,
                                        recycle=self.schedule.describe() if self.schedule else None,
                                        layers=sorted(self.layer_map or {}))

    # ------------------------------------------------------------------ setup and teardown
    def check_targets(self, trainer, pl_module) -> None:
        self.layers = find_neuron_layers(pl_module, self.layer_map, selection=self.selection, owner=self.owner)
        if not self.layers:
            raise ValueError(f"ReDoMonitor found no neuron layers: {candidates_hint(pl_module)}. Pass "
                             "layer_map={name: (up_or_[gate, up], down)} or declare_plasticity(model, neurons=...)")
        banner = f"ReDoMonitor watches {len(self.layers)} layers: {', '.join(l.name for l in self.layers)}"
        if banner != self._announced:  # once per fit, not again at each validate() and fit() setup of the same model
            rank_zero_info(banner)
            self._announced = banner

    def attach(self, trainer, pl_module) -> None:
        if self._ema is None:
            device = self.layers[0].up.weight.device
            total = sum(layer.width for layer in self.layers)
            self._ema = torch.zeros(total, device=device)
            self._observed = torch.zeros(total, dtype=torch.bool, device=device)
            self._recycled = torch.zeros(len(self.layers), dtype=torch.long, device=device)
            self._nonfinite = torch.zeros(len(self.layers), dtype=torch.long, device=device)
            with torch.no_grad():  # the layers' own init scale, unless a checkpoint restores the one recorded
                self._init_std = torch.stack([_init_stds(layer) for layer in self.layers])
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
        self._remove_hooks()
        self._attach_collectors(pl_module)

    def on_fit_end(self, trainer, pl_module) -> None:
        self._remove_hooks()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()

    def _attach_collectors(self, pl_module) -> None:
        """One collector per ``down`` layer (several ReDo layers may read slices of one), fed by the
        owning block's ``hidden_observer`` where the block has a free one, else by a pre-hook."""
        groups: dict[int, tuple[nn.Module, list]] = {}
        experts: dict[int, tuple[nn.Module, dict]] = {}  # id(experts module) -> (module, {expert: entry})
        offset = 0
        for index, layer in enumerate(self.layers):
            entry = (index, slice(offset, offset + layer.width))
            if layer.experts is not None:
                experts.setdefault(id(layer.experts), (layer.experts, {}))[1][layer.up.expert] = entry
            else:
                groups.setdefault(id(layer.down), (layer.down, []))[1].append(entry)
            offset += layer.width
        self._readers.reset(pl_module)
        for module, entries in experts.values():
            collector = _ExpertCollector(self, entries, self.layers[next(iter(entries.values()))[0]].up)
            self._readers.pre_hook(module, collector, with_kwargs=True)
        for down, entries in groups.values():
            self._readers.read(down, _HiddenCollector(self, entries))

    def _remove_hooks(self) -> None:
        self._readers.remove()
        self._collecting = False

    # ------------------------------------------------------------------ collection (hot path)
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._collecting = trainer.global_step % self.collect_every_n_steps == 0
        self.collections += int(self._collecting)
        self._seen = False
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @torch.no_grad()
    def _collect(self, module: nn.Module, h: torch.Tensor, entries: list[tuple[int, slice]]) -> None:
        if not (self._collecting and module.training):  # e.g. another callback's eval forward inside the step
            return
        h = h.detach()
        for index, view in entries:
            layer = self.layers[index]
            units, unit = layer.unit_activity(h)  # this layer's units, whatever down's input layout
            activity = mean_abs_activation(units, unit)
            # A batch with NaN/Inf activations (e.g. one the training step skips) must not enter the EMA: a single
            # NaN would make every score NaN, and nothing dormant, for the rest of training. Skip and count it,
            # with masks rather than an `if`, so the hot path never waits for the device.
            finite = torch.isfinite(activity).all()
            # A first observation replaces. Explicit float32: under bf16-true the default dtype is bf16.
            weight = torch.where(self._observed[view], 1.0 - self.ema_decay, 1.0).to(self._ema.dtype)
            self._ema[view].lerp_(torch.where(finite, activity.to(self._ema.dtype), self._ema[view]), weight)
            self._observed[view] |= finite
            self._nonfinite[index] += (~finite).long()
        self._seen = True

    # ------------------------------------------------------------------ decisions
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self._collecting and not self._seen and pl_module.training:
            raise RuntimeError(
                "ReDoMonitor saw no activations in a collecting training step: no watched layer ran in train "
                "mode, or its forward hooks were not called, which happens when the model was compiled "
                "(torch.compile) and traced before the hooks were added. Attach ReDoMonitor before the first "
                "compiled forward, or give the blocks a hidden_observer slot (see models/blocks/mlp.py).")
        self._collecting = False
        step = trainer.global_step
        recycle = self.firing.due_at_step(trainer) if self.firing is not None else None
        log_now = step % self.log_every_n_steps == 0 and step != self.last_logged_step
        if self.collections == 0 or not (log_now or recycle) or step == 0:
            return
        self._step_scores = self.scores(trainer)  # the one all-reduce: every rank decides on the same numbers
        self._warn_unobserved()
        if log_now:  # measured every log_every_n_steps only: written at this step, never repeated in later rows
            self.last_logged_step = step
            log_at_step(trainer, self._fractions(self._step_scores))
        self.act_if(recycle, trainer, pl_module)
        self._step_scores = None

    def act(self, trainer, pl_module, reason: str) -> dict[str, torch.Tensor]:
        if self.collections == 0:
            rank_zero_warn(f"ReDoMonitor ({reason}): no training step observed yet in this fit; nothing recycled")
            return {}
        scores = self._step_scores if self._step_scores is not None else self.scores(trainer)
        return self._recycle(trainer, pl_module, self.dormant_masks(scores, self.tau), trainer.global_step)

    def scores(self, trainer=None) -> dict[str, torch.Tensor]:
        """Score per neuron for each layer. With ``trainer`` under DDP the statistics are first averaged
        over ranks (a collective: call it on every rank); without, this process's statistics."""
        if self._ema is None:
            return {}
        self._ema.copy_(all_reduce_mean(trainer, self._ema.clone()))
        return {layer.name: dormancy_scores(part) for layer, part in zip(self.layers, self._split(self._ema))}

    def _warn_unobserved(self) -> None:
        """Layers whose ``down`` never ran in a collected training step have no statistics: say so, once
        per fit, instead of logging them as 0 % dormant (a compiled model or another forward path)."""
        if self._warned_unobserved or bool(self._observed.all()):
            return
        silent = [layer.name for layer, seen in zip(self.layers, self._split(self._observed)) if not bool(seen.any())]
        if silent:
            self._warned_unobserved = True
            rank_zero_warn(f"ReDoMonitor observed no activation of {silent} after {self.collections} collected "
                           "steps: their forward hooks never ran in training (a model compiled before the hooks were "
                           "attached, or a forward path that bypasses these modules); their dormancy is unknown and "
                           "they are not recycled. Attach ReDoMonitor before compiling, or pass layer_map= for the "
                           "modules that do run.")

    def dormant_masks(self, scores: dict[str, torch.Tensor], tau: float) -> dict[str, torch.Tensor]:
        """τ-dormant neurons per layer, among those observed since fit start or their recycling
        (a layer whose forward never ran in training has no statistics, not dead neurons)."""
        observed = dict(zip(scores, self._split(self._observed)))
        return {name: dormant_mask(s, tau) & observed[name] for name, s in scores.items()}

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(flat, [layer.width for layer in self.layers])

    def _fractions(self, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        total = sum(layer.width for layer in self.layers)
        metrics = {}
        for key, tau in (("dormant", self.tau), ("dead", 0.0)):
            counts = {name: mask.sum() for name, mask in self.dormant_masks(scores, tau).items()}
            for layer in self.layers:
                metrics[f"redo/{key}/{layer.name}"] = counts[layer.name] / layer.width
            metrics[f"redo/{key}"] = sum(counts.values()) / total
        metrics["redo/nonfinite_batches"] = self._nonfinite.sum().float()
        return metrics

    def _recycle(self, trainer, pl_module, masks: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        init = self._recorded_init if self.init == "init_std" else self.init
        seed = rank_identical_generator(self.seed, step).initial_seed()  # with the layer's index: every rank alike
        counts = recycle_(pl_module, self.layers, masks, trainer.optimizers, init, seed, self.owner)
        offset, metrics = 0, {}
        for layer in self.layers:
            # A recycled neuron is a new neuron: its next observation replaces its EMA.
            self._observed[offset:offset + layer.width].masked_fill_(masks[layer.name], False)
            offset += layer.width
            metrics[f"redo/recycled/{layer.name}"] = counts[layer.name].float()
        counts = torch.stack(list(counts.values()))
        self._recycled += counts
        metrics["redo/recycled"] = counts.sum().float()
        return metrics

    def _recorded_init(self, index: int, layer: HiddenUnits) -> tuple[torch.Tensor, torch.Tensor]:
        """``N(0, σ)`` with the std of ``up`` and ``gate`` recorded at the start of the first fit."""
        return self._init_std[index, 0], self._init_std[index, 1]

    # ------------------------------------------------------------------ figure
    def on_train_end(self, trainer, pl_module) -> None:
        from .figures import can_draw
        super().on_train_end(trainer, pl_module)  # the base's fit-end check of the schedule

        if not self.plot_scores or self.collections == 0 or not can_draw("ReDoMonitor", "plot_scores"):
            return
        scores = self.scores(trainer)  # collective: on every rank
        if trainer.global_rank == 0:
            from .figures import new_figure, save_figure

            fig = new_figure(figsize=(6, 1.8 * len(scores)))
            axes = fig.subplots(len(scores), 1, squeeze=False)
            for ax, (name, s) in zip(axes[:, 0], scores.items()):
                ax.hist(s.cpu().numpy(), bins=50)
                ax.axvline(self.tau, color="red", linestyle="--", label=f"tau={self.tau}")
                ax.set_title(name, fontsize=8)
            axes[-1, 0].set_xlabel("dormancy score (1 = layer mean)")
            axes[0, 0].legend(fontsize=7)
            fig.tight_layout()
            save_figure(fig, trainer, f"redo_scores_step{trainer.global_step}")

    # ------------------------------------------------------------------ resume
    def extra_state(self) -> dict:
        if self._ema is None:  # not fitted yet: what a checkpoint brought, if anything
            return dict(self._pending_state or {})
        return {"layers": [l.name for l in self.layers], "widths": [l.width for l in self.layers],
                "ema": self._ema.detach().cpu().clone(), "observed": self._observed.cpu().clone(),
                "recycled": self._recycled.cpu().clone(), "init_std": self._init_std.cpu().clone(),
                "nonfinite_batches": self._nonfinite.cpu().clone(),
                "collections": self.collections, "last_logged_step": self.last_logged_step}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) <= {"schedule", "pending_logs"}:  # written before any fit: no statistics to restore
            return
        super().load_state_dict(state_dict)

    def load_extra_state(self, state: dict) -> None:
        check_state_shapes(state)  # refused at load, not as a crash mid-fit
        self._pending_state = dict(state)
        if self._ema is not None:  # strategies that restore after on_fit_start
            self._apply_state(self._pending_state)

    def _apply_state(self, state: dict) -> None:
        names, widths = [l.name for l in self.layers], [l.width for l in self.layers]
        if state["layers"] != names or state["widths"] != widths:
            raise ValueError(f"ReDoMonitor checkpoint watched layers {list(zip(state['layers'], state['widths']))}, "
                             f"this model has {list(zip(names, widths))}")
        # A checkpoint written before non-finite batches were skipped may hold NaN scores: those neurons
        # count as not yet observed, so their next batch replaces the value instead of keeping it NaN.
        finite = torch.isfinite(state["ema"]).to(self._ema.device)
        self._ema.copy_(torch.where(finite, state["ema"].to(self._ema.device), 0.0))
        self._observed.copy_(state["observed"].to(self._observed.device) & finite)
        self._recycled.copy_(state["recycled"])
        self._nonfinite.copy_(state.get("nonfinite_batches", torch.zeros_like(self._nonfinite)))
        self._init_std = state["init_std"].to(self._ema.device)
        self.collections = state["collections"]
        self.last_logged_step = state["last_logged_step"]
        self._pending_state = None


class _HiddenCollector:
    """Hands the input of one ``down`` layer to the monitor with the EMA slices it feeds.

    A plain object, kept for the whole fit: ``torch.compile`` guards on what it reads, so the
    same collector never triggers a re-trace.
    """

    def __init__(self, monitor: ReDoMonitor, entries: list[tuple[int, slice]]):
        self.monitor, self.entries = monitor, entries

    def __call__(self, module: nn.Module, h: torch.Tensor) -> None:
        self.monitor._collect(module, h, self.entries)


class _ExpertCollector:
    """Hands the monitor each routed expert's units, computed by :func:`~model_map.experts.expert_hidden` from
    the experts module's inputs (only on collecting steps: it reads the routed experts on the host)."""

    def __init__(self, monitor: ReDoMonitor, entries: dict[int, tuple[int, slice]], up: ExpertMatrix):
        self.monitor, self.entries, self.up = monitor, entries, up

    @torch.no_grad()
    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not (self.monitor._collecting and module.training):
            return
        for expert, h in expert_hidden(module, args, kwargs, self.up.attr, self.up.transposed):
            if expert in self.entries:
                self.monitor._collect(module, h, [self.entries[expert]])


def check_state_shapes(state: dict) -> None:
    """Refuse, at load, a ReDoMonitor state whose tensors do not fit its own ``layers`` and ``widths``
    (a damaged or edited checkpoint would otherwise load and fail mid-fit)."""
    widths = state["widths"]
    if len(widths) != len(state["layers"]) or not all(isinstance(w, int) and w > 0 for w in widths):
        raise CheckpointError(f"ReDoMonitor.load_state_dict: widths {widths} do not match layers {state['layers']} "
                              "(a positive neuron count per layer); the checkpoint is damaged or from another model")
    total, n = sum(widths), len(widths)
    expected = {"ema": (total,), "observed": (total,), "recycled": (n,), "init_std": (n, 2), "nonfinite_batches": (n,)}
    wrong = [f"{key} {tuple(state[key].shape)} (expected {shape})" for key, shape in expected.items()
             if key in state and tuple(state[key].shape) != shape]
    if wrong:
        raise CheckpointError(f"ReDoMonitor.load_state_dict: tensors of the wrong shape for {n} layers of "
                              f"{total} neurons: {', '.join(wrong)}; the checkpoint is damaged or from another model")


def _init_stds(layer: HiddenUnits) -> torch.Tensor:
    """``[std(up.weight), std(gate.weight)]`` (the gate's is up's when there is no gate), on device."""
    gate = layer.up if layer.gate is None else layer.gate
    return torch.stack([finite_std(layer.up.weight), finite_std(gate.weight)])
