"""``ContinualBackprop``: Dohare et al.'s generate-and-test, replacing a trickle of low-utility units every step."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from ..arguments import check_int, check_number
from ..distributed.strategy import all_reduce_mean, is_dtensor, rank_identical_generator
from ..model_map import HiddenUnits, Selection, check_layer_map, find_neuron_layers, is_conv1d
from ..model_map.experts import expert_hidden
from ..model_map.hidden_inputs import HiddenInputReaders
from ..model_map.neurons import candidates_hint, stores_in_out
from ..ops.neuron_reset import reset_norm_channels, zero_unit_state
from ..distributed.sharding import local_part
from ..functional import continual_backprop as cbp
from .base import PlasticityCallback


class ContinualBackprop(PlasticityCallback):
    """Continual Backprop (Dohare et al., Nature 2024): every step, replace the ``ρ`` share of mature
    hidden units with the lowest utility by fresh ones.

    **Units** are the model map's neuron layers (:func:`~model_map.find_neuron_layers`,
    the ones ReDo recycles): MLPs, CNN channels, transformer MLPs (our GPT, Hugging Face GPT-2 / Llama /
    BERT / GPT-J, litgpt), each expert of a mixture-of-experts stack, ``up -> act -> down`` read from the
    model's own forward under any names (Nemotron, RWKV), or an explicit ``layer_map``; ``selection`` picks among
    them, as for every method, and what cannot be paired is named in one warning with its ``layer_map``. An
    expert's statistics come from the tokens routed to it; a step that routes none to it leaves its
    statistics and age as they were (under DDP its ``f̂`` is each rank's own, averaged after the step).
    **Collects**, from the input of each ``down`` layer (read through the block's ``hidden_observer`` slot where it
    has a free one, else a forward pre-hook; training forwards only; with gradient accumulation, the optimizer
    step's last micro-batch), the batch mean ``E[h_i]`` and ``E|h_i - f̂_i|``. **Acts** in ``on_train_batch_end`` of each batch whose optimizer stepped, as the reference runs
    generate-and-test after ``opt.step()``: the statistics of
    :mod:`plasticity_callbacks.functional.continual_backprop` are updated with the weight magnitudes after
    the step, and the chosen units get incoming rows from ``U(±bound(fan_in))`` (``init``; a gate's rows
    too), zero incoming bias (a BatchNorm channel between up and the activation: a fresh one), zero outgoing
    weights, their mean contribution moved into ``down``'s bias (``bias_correction``), and the optimizer
    moments of those rows and columns zeroed (torch's Adam keeps one step count per tensor, so unlike the
    reference's per-element ``AdamGnT`` the bias-correction clock of those moments is not restarted).
    Logs ``cbp/replaced`` (units replaced so far).

    Choices the paper leaves open follow the reference code (``shibhansh/loss-of-plasticity``,
    ``lop/algos/gnt.py``): mean, not sum, of outgoing/incoming weight magnitudes; utilities and means
    bias-corrected by ``1 - η^age``; the fractional count accumulated across steps (``accumulate=True``);
    layers processed in order, each re-drawn then its outgoing columns zeroed. One difference, on purpose:
    the reference zeroes a replaced unit's mean before it moves that mean into the next bias, so its bias
    correction adds 0; here the mean is moved (``bias_correction=False`` reproduces the reference exactly).
    A channel flattened into a Linear scores ``mean|w_out| · E|h - f̂|`` over its positions (the reference's
    CNN code averages the per-position products).

    **DDP**: the batch statistics are averaged over ranks before each update (the batch mean already in the
    forward, as ``E|h - f̂|`` needs the global batch's ``f̂``) and the new rows come from a generator seeded from
    ``(seed, global_step)``, so every rank replaces the same units identically, those of one process.
    **FSDP2** (``DTensor`` weights sharded by rows): the same, with the weight magnitudes summed over each
    rank's shard and then over the ranks; every rank draws all the new rows and writes those its shards hold,
    and zeroes the outgoing weights it holds. The per-unit statistics are small vectors, the same on every
    rank, kept whole. FSDP1 and DeepSpeed are refused in ``setup``. Statistics, ages and carried counts are in
    ``state_dict``.
    It acts every step, so it takes no schedule.

    Args:
        replacement_rate: ``ρ`` in (0, 1], the share of mature units replaced per step (paper: 1e-4 to 1e-6).
        maturity_threshold: ``m``, steps a unit is protected after it is created (paper: 100).
        decay_rate: ``η`` in [0, 1) of the running utility and mean (paper: 0.99).
        utility: ``adaptable_contribution`` (contribution × adaptation) or ``contribution``.
        init: bound of the uniform re-draw: ``kaiming`` (``√2·√(3/fan_in)``, the reference's), ``lecun``
            (``√(3/fan_in)``) or ``default`` (``1/√fan_in``, PyTorch's Linear init).
        bias_correction: move a replaced unit's mean contribution into ``down``'s bias.
        layer_map: ``{name: (up | [gate, up], down)}`` by module names; None: found automatically.
        selection: which layers it acts on (a :class:`~model_map.Selection` or a mapping of its fields, as for
            every method): a layer whose ``up`` (and gate) weights it selects; ``scope="mlp"``, ``include`` and
            ``exclude`` patterns on parameter names. ``layer_map`` is the explicit declaration instead.
        seed: mixed with the global step into the re-draw generator.

    Example:
        >>> cbp = ContinualBackprop(replacement_rate=1e-4, maturity_threshold=100)
        >>> trainer = L.Trainer(callbacks=[cbp], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # logs cbp/replaced
    """

    supports_fsdp2 = True  # FSDP2: rows and columns of shards
    every_step_hook = "on_train_batch_end"  # generate-and-test after every optimizer step
    quick_settings = {"replacement_rate": 0.2, "maturity_threshold": 1}  # replace from step 1
    summary_metrics = ("cbp/replaced",)
    default_schedule = None  # generate-and-test runs every step
    extra_state_types = {"layers": list, "stats": list, "carry": list, "replaced": int}

    def __init__(self, replacement_rate: float = 1e-4, maturity_threshold: int = 100, decay_rate: float = 0.99,
                 utility: str = "adaptable_contribution", init: str = "kaiming", bias_correction: bool = True,
                 layer_map: Mapping | None = None, seed: int = 0,
                 selection: Selection | Mapping | None = None):
        check_number("replacement_rate", replacement_rate, 0.0, 1.0, "(0 replaces nothing; paper: 1e-4)", low_open=True)
        check_int("maturity_threshold", maturity_threshold, 0, hint="(paper: 100)")
        check_number("decay_rate", decay_rate, 0.0, 1.0, "(1 never updates the utility; paper: 0.99)", high_open=True)
        if utility not in cbp.KINDS:
            raise ValueError(f"utility={utility!r} is not one of {cbp.KINDS}")
        if init not in cbp.BOUNDS:
            raise ValueError(f"init={init!r} is not one of {tuple(cbp.BOUNDS)}")
        if not isinstance(bias_correction, bool):
            raise ValueError(f"bias_correction={bias_correction!r} must be true or false")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed={seed!r} must be an integer")
        layer_map = check_layer_map(layer_map, "ContinualBackprop")
        super().__init__(None, Selection.build(selection, "ContinualBackprop"))
        self.rate, self.maturity, self.decay = float(replacement_rate), maturity_threshold, float(decay_rate)
        self.utility, self.init, self.bias_correction, self.seed = utility, init, bias_correction, seed
        self.layer_map = layer_map
        self.exclude = list(self.selection.exclude) if self.selection.exclude else None
        self.layers: list[HiddenUnits] = []
        self.stats: list[dict[str, torch.Tensor]] = []  # per layer: util, mean, age
        self.carry: list[float] = []  # per layer: fractional replacements owed
        self.replaced = 0
        self._batch: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per layer: (E[h], E|h - f̂|) of this step
        self._pending: dict | None = None
        self._readers = HiddenInputReaders()  # the collectors fed with down's input
        self._last_step = -1
        self._trainer = None

    @property
    def state_key(self) -> str:
        return self._generate_state_key(rate=self.rate, maturity=self.maturity, layers=sorted(self.layer_map or {}))

    def check_targets(self, trainer, pl_module) -> None:
        self.layers = find_neuron_layers(pl_module, self.layer_map, selection=self.selection, owner=self.owner)
        if not self.layers:
            raise ValueError(f"ContinualBackprop found no hidden-unit layers: {candidates_hint(pl_module)}. Pass "
                             "layer_map={name: (up_or_[gate, up], down)} or declare_plasticity(model, neurons=...)")
        unbiased = [layer.name for layer in self.layers if getattr(layer.down, "bias", None) is None]
        if self.bias_correction and unbiased:
            rank_zero_warn(f"ContinualBackprop: the down layers of {unbiased} have no bias, so replaced units' mean "
                           "contribution is dropped there; pass bias_correction=False to say that is intended")
        rank_zero_info(f"ContinualBackprop watches {len(self.layers)} layers: {', '.join(l.name for l in self.layers)}")

    def attach(self, trainer, pl_module) -> None:
        self._trainer = trainer  # the strategy's collectives, for the forward hooks
        if not self.stats:
            device = self.layers[0].up.weight.device
            self.stats = [{key: torch.zeros(layer.width, device=device) for key in ("util", "mean", "age")}
                          for layer in self.layers]
            self.carry = [0.0] * len(self.layers)
        if self._pending is not None:
            self._restore(self._pending)
        self._batch = [None] * len(self.layers)
        self._remove_hooks()
        self._readers.reset(pl_module)
        experts: dict[int, tuple[nn.Module, dict[int, int]]] = {}  # id(experts module) -> (module, {expert: index})
        for index, layer in enumerate(self.layers):
            if layer.experts is not None:
                experts.setdefault(id(layer.experts), (layer.experts, {}))[1][layer.up.expert] = index
            else:
                self._readers.read(layer.down, _Collector(self, index))
        for module, indices in experts.values():
            self._readers.pre_hook(module, _ExpertCollector(self, indices), with_kwargs=True)
        self._last_step = trainer.global_step

    def on_fit_end(self, trainer, pl_module) -> None:
        self._remove_hooks()
        self._trainer = None

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()
        self._trainer = None

    def _remove_hooks(self) -> None:
        self._readers.remove()

    @torch.no_grad()
    def collect(self, index: int, module: nn.Module, h: torch.Tensor) -> None:
        """Batch statistics of layer ``index`` from ``down``'s input ``h`` (training forwards only)."""
        if not module.training:
            return
        units, unit_dim = self.layers[index].unit_activity(h.detach())
        units = units.movedim(unit_dim, -1).reshape(-1, units.shape[unit_dim]).float()  # (samples, units)
        stats = self.stats[index]
        # The adaptation term measures h against f̂, which holds this step's mean over the whole global batch:
        # with several ranks the mean is reduced here, in the forward (a (units,) vector per layer; every rank runs
        # the same training forwards), so that each rank's E|h - f̂| averages to one process's. An expert sees only
        # the tokens routed to it, which differ between ranks: its f̂ is this rank's (no collective per expert).
        reduce = self.utility != "contribution" and self.layers[index].experts is None
        batch_mean = all_reduce_mean(self._trainer, units.mean(0)) if reduce else units.mean(0)
        if self.utility == "contribution":
            activity = units.abs().mean(0)
        else:
            activity = (units - cbp.corrected_mean(stats["mean"], batch_mean, stats["age"] + 1, self.decay)).abs().mean(0)
        self._batch[index] = (batch_mean, activity)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not pl_module.training or trainer.global_step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = trainer.global_step
        if self.skip_nonfinite(trainer, pl_module, "generate-and-test"):  # its statistics would turn NaN for good
            self._batch = [None] * len(self.layers)
            return
        # An expert that no token was routed to in this step has no statistics: it waits (its age too).
        missing = [layer.name for layer, seen in zip(self.layers, self._batch) if seen is None and layer.experts is None]
        if missing:
            raise RuntimeError(f"ContinualBackprop saw no activations of {missing} in this training step: their forward "
                               "hooks did not run (a model compiled before the callback attached, or a forward that "
                               "bypasses these modules); attach it before compiling or pass layer_map= / selection={'exclude': [...]}")
        device = self.layers[0].up.weight.device
        seen = [(pair, 1.0) if pair is not None else ((torch.zeros(l.width, device=device),) * 2, 0.0)
                for l, pair in zip(self.layers, self._batch)]
        flat = torch.cat([torch.cat([*pair, torch.tensor([ran], device=device)]) for pair, ran in seen])
        flat = all_reduce_mean(trainer, flat)  # every rank decides on the same numbers
        generator = rank_identical_generator(self.seed, trainer.global_step, device=device)
        chosen = []
        for layer, stats, part in zip(self.layers, self.stats, flat.split([2 * l.width + 1 for l in self.layers])):
            batch_mean, activity, ran = part.split([layer.width, layer.width, 1])
            if layer.experts is not None:  # the mean over the ranks that routed tokens to this expert
                if not bool(ran > 0):
                    chosen.append(None)
                    continue
                batch_mean, activity = batch_mean / ran, activity / ran
            stats["age"] += 1
            unit_mean = cbp.corrected_mean(stats["mean"], batch_mean, stats["age"], self.decay)
            stats["util"], stats["mean"], corrected = cbp.update_statistics(
                stats["util"], stats["mean"], stats["age"], self.decay, activity, batch_mean,
                _outgoing_magnitude(layer), _incoming_magnitude(layer), self.utility)
            chosen.append((corrected, unit_mean))
        count = 0
        for index, (layer, stats, statistics) in enumerate(zip(self.layers, self.stats, chosen)):
            if statistics is None:
                continue
            corrected, unit_mean = statistics
            units, self.carry[index] = cbp.units_to_replace(corrected, stats["age"], self.maturity, self.rate,
                                                            self.carry[index])
            if units.numel():
                self._replace(trainer, layer, units, unit_mean, generator)
                for key in ("util", "mean", "age"):
                    stats[key][units] = 0
                count += units.numel()
        self.replaced += count
        self._batch = [None] * len(self.layers)
        # the running count, measured at every optimizer step: Lightning writes it at its log_every_n_steps cadence
        pl_module.log("cbp/replaced", float(self.replaced), on_step=True, on_epoch=False)

    @torch.no_grad()
    def _replace(self, trainer, layer: HiddenUnits, units: torch.Tensor, unit_mean: torch.Tensor, generator) -> None:
        for incoming in (layer.up, layer.gate):
            if incoming is None:
                continue
            rows = _rows(incoming)
            picked = layer.incoming_rows(units)  # a fused layer: the unit's two rows
            # every rank draws all the new rows (one generator, the same on every rank) and writes those it holds
            new = cbp.draw_rows(len(picked), rows, cbp.BOUNDS[self.init](rows[0].numel()), generator)
            _redraw_incoming_(incoming, picked, new)
            mask = _mask(picked, rows.shape[0])
            zero_unit_state(trainer.optimizers, incoming, "weight", mask, int(stores_in_out(incoming)))
            if getattr(incoming, "bias", None) is not None:
                zero_unit_state(trainer.optimizers, incoming, "bias", mask, 0)
        _retire_outgoing_(layer, units, unit_mean if self.bias_correction else None)
        columns = cbp.unit_columns(units, layer.down_offset, layer.group)
        zero_unit_state(trainer.optimizers, layer.down, "weight", _mask(columns, _rows(layer.down).shape[1]),
                        int(not stores_in_out(layer.down)))
        if layer.norm is not None:  # a fresh BatchNorm channel: scale 1, shift 0, statistics of a new layer
            reset_norm_channels(layer.norm, _mask(units, layer.width), optimizer=None)

    def extra_state(self) -> dict:
        if not self.stats:
            return dict(self._pending or {"layers": [], "stats": [], "carry": [], "replaced": 0})
        return {"layers": [l.name for l in self.layers],
                "stats": [{k: v.detach().cpu().clone() for k, v in s.items()} for s in self.stats],
                "carry": list(self.carry), "replaced": self.replaced}

    def load_extra_state(self, state: dict) -> None:
        if not state["layers"]:  # saved before the first fit started: nothing to restore
            return
        self._pending = dict(state)
        if self.stats:  # strategies that restore after on_fit_start
            self._restore(self._pending)

    def _restore(self, state: dict) -> None:
        names = [l.name for l in self.layers]
        if state["layers"] != names:
            raise ValueError(f"ContinualBackprop checkpoint watched layers {state['layers']}, this model has {names}")
        for mine, saved in zip(self.stats, state["stats"]):
            for key, value in mine.items():
                value.copy_(saved[key])
        self.carry, self.replaced, self._pending = [float(c) for c in state["carry"]], state["replaced"], None


class _ExpertCollector:
    """Hands the owner each routed expert's units (:func:`~model_map.experts.expert_hidden`)."""

    def __init__(self, owner: ContinualBackprop, indices: dict[int, int]):
        self.owner, self.indices = owner, indices

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training:
            return
        layer = self.owner.layers[next(iter(self.indices.values()))]
        with torch.no_grad():
            for expert, h in expert_hidden(module, args, kwargs, layer.up.attr, layer.up.transposed):
                if expert in self.indices:
                    self.owner.collect(self.indices[expert], module, h)


class _Collector:
    """Hands the callback one layer's ``down`` input; a plain object kept for the fit (a compiled graph guards on
    it)."""

    def __init__(self, owner: ContinualBackprop, index: int):
        self.owner, self.index = owner, index

    def __call__(self, module: nn.Module, h: torch.Tensor) -> None:
        self.owner.collect(self.index, module, h)


def _rows(layer: nn.Module) -> torch.Tensor:
    """``layer.weight`` as ``(out, in, *kernel)`` (a view: HF ``Conv1D``, transposed convs and some experts store
    ``(in, out)``)."""
    return layer.weight.transpose(0, 1) if stores_in_out(layer) else layer.weight


def _mask(indices: torch.Tensor, size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.bool, device=indices.device).index_fill_(0, indices, True)


def _incoming_magnitude(layer: HiddenUnits) -> torch.Tensor:
    """``mean |w_in[i, :]|`` per unit ``i`` (a fused [gate | up] layer: over the unit's row in both halves)."""
    rows = _mean_abs(_rows(layer.up), keep=0)
    if not layer.fused_gate:
        return rows
    return rows.view(layer.width, 2).mean(1) if layer.interleaved else rows.view(2, layer.width).mean(0)


def _outgoing_magnitude(layer: HiddenUnits) -> torch.Tensor:
    """``mean_k |w_out[k, i]|`` per unit ``i``, over ``down``'s outputs, kernel taps and the unit's positions."""
    reads = _mean_abs(_rows(layer.down), keep=1)  # (reads,)
    return reads.narrow(0, layer.down_offset, layer.width * layer.group).view(layer.width, layer.group).mean(1)


def _mean_abs(weight: torch.Tensor, keep: int) -> torch.Tensor:
    """``mean |w|`` over every dim of ``weight`` but ``keep``, whole on every rank. A FSDP2 ``DTensor``: sums of
    each rank's shard, then all-gathered (``keep`` sharded) or all-reduced (a sum over the sharded dim)."""
    weight = weight.detach()
    if not is_dtensor(weight):
        return weight.abs().movedim(keep, 0).flatten(1).float().mean(1)
    dims = [d for d in range(weight.dim()) if d != keep]
    return weight.abs().float().sum(dims).full_tensor() / (weight.numel() // weight.shape[keep])


def _held(indices: torch.Tensor, span: slice, held: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Of ``indices`` along a dim of which this rank holds ``span`` (``held`` entries): their local positions
    and which of ``indices`` they are (a plain tensor: all of them)."""
    start = span.start or 0
    mine = (indices >= start) & (indices < start + held)
    return indices[mine] - start, mine


@torch.no_grad()
def _redraw_incoming_(layer: nn.Module, units: torch.Tensor, new_rows: torch.Tensor) -> None:
    """Rows ``units`` of ``layer``'s ``(out, in)`` weight become ``new_rows``, their bias 0; under FSDP2 each rank
    writes what its shards hold (HF ``Conv1D``, stored ``(in, out)``: its inputs of every unit)."""
    bias = getattr(layer, "bias", None)
    if not is_dtensor(layer.weight):
        cbp.redraw_incoming_(_rows(layer), bias, units, new_rows)
        return
    local, span = local_part(layer.weight)
    if is_conv1d(layer):
        local[:, units] = new_rows[:, span].mT.to(local.dtype)
    else:
        where, mine = _held(units, span, local.shape[0])
        local[where] = new_rows[mine].to(local.dtype)
    if bias is not None:
        local_bias, span = local_part(bias)
        local_bias[_held(units, span, local_bias.shape[0])[0]] = 0


@torch.no_grad()
def _retire_outgoing_(layer: HiddenUnits, units: torch.Tensor, unit_mean: torch.Tensor | None) -> None:
    """Zero ``units``' outgoing weights in ``down``, first moving their mean contribution into its bias
    (:func:`~functional.continual_backprop.retire_outgoing_`). Under FSDP2 a
    Linear/conv ``down`` holds whole output rows on each rank, and their bias entries: the same computation on
    the shards. HF ``Conv1D`` (stored ``(reads, out)``) holds some reads of every output: each rank's part of
    the bias change is summed over the ranks (one all-reduce), then each zeroes the reads it holds."""
    down, bias = layer.down, getattr(layer.down, "bias", None)
    if not is_dtensor(down.weight):
        cbp.retire_outgoing_(_rows(down), bias, units, unit_mean, layer.down_offset, layer.group)
        return
    if not is_conv1d(down):  # whole output rows and their bias entries on each rank
        cbp.retire_outgoing_(local_part(down.weight)[0], None if bias is None else local_part(bias)[0], units,
                             unit_mean, layer.down_offset, layer.group)
        return
    if units.numel() == 0:
        return
    local, span = local_part(down.weight)  # (reads held, out)
    columns = cbp.unit_columns(units, layer.down_offset, layer.group)
    where, mine = _held(columns, span, local.shape[0])
    if bias is not None and unit_mean is not None:
        means = unit_mean[units].repeat_interleave(layer.group)[mine].to(local.dtype)
        change = (local[where] * means[:, None]).sum(0)  # (out,): this rank's reads
        torch.distributed.all_reduce(change, group=down.weight.device_mesh.get_group())
        local_bias, bias_span = local_part(bias)
        local_bias += change[bias_span].to(local_bias.dtype)
    local[where] = 0
