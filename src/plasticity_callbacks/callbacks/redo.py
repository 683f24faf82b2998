"""``ReDoMonitor``: watch dormant neurons during training and optionally recycle them (ReDo)."""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from ..core.distributed import all_reduce_mean, rank_identical_generator, require_full_parameters
from ..functional.dormancy import INITS, dormancy_scores, dormant_mask, mean_abs_activation, reinit_incoming, zero_outgoing
from ..core.targets import output_head, select_targets, validate_patterns
from ..core.arguments import check_int, check_number

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_LAYER = (nn.Linear, *_CONV)
# Activations that act on each unit alone; softmax-like and GLU modules mix units, so they
# do not delimit a neuron. Dropout may sit between the activation and the next layer.
_MIXING = (nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d, nn.GLU, nn.MultiheadAttention)
_ACTIVATIONS = tuple(
    c for c in vars(nn.modules.activation).values()
    if isinstance(c, type) and issubclass(c, nn.Module) and c.__module__ == nn.modules.activation.__name__
    and not issubclass(c, _MIXING)
)
_PASS_THROUGH = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.Identity)
CALLBACK_INITS = ("init_std", *INITS)


@dataclass
class NeuronLayer:
    """Hidden units between ``up`` (and ``gate``) and ``down``; their value is ``down``'s input."""

    name: str
    up: nn.Module
    down: nn.Module
    gate: nn.Module | None = None
    down_offset: int = 0  # this layer's units are down's inputs [offset, offset + width)

    @property
    def width(self) -> int:
        return self.up.weight.shape[0]

    def neuron_dim(self, x: torch.Tensor) -> int:
        """The unit axis of ``down``'s input: last for a Linear, the channel axis for a conv."""
        return x.dim() - 1 if isinstance(self.down, nn.Linear) else x.dim() - (self.down.weight.dim() - 1)


def _check_pair(name: str, up: nn.Module, down: nn.Module, gate: nn.Module | None, down_offset: int | None = None) -> None:
    """``down_offset=None``: down must read exactly up's units; else the slice from the offset must fit."""
    for role, layer in (("up", up), ("down", down), ("gate", gate)):
        if layer is not None and not isinstance(layer, _LAYER):
            raise ValueError(f"ReDoMonitor layer {name!r}: {role} is a {type(layer).__name__}, not an nn.Linear or conv")
    reads, writes = down.weight.shape[1], up.weight.shape[0]
    fits = reads == writes if down_offset is None else down_offset + writes <= reads
    if getattr(down, "groups", 1) != 1 or not fits:
        raise ValueError(f"ReDoMonitor layer {name!r}: down reads {reads} units (groups={getattr(down, 'groups', 1)}, "
                         f"offset={down_offset or 0}), up writes {writes}")
    if gate is not None and gate.weight.shape[0] != up.weight.shape[0]:
        raise ValueError(f"ReDoMonitor layer {name!r}: gate writes {gate.weight.shape[0]} units, up {up.weight.shape[0]}")


def _sequential_pairs(model: nn.Module):
    """``(name, up, down)`` for ``Linear/conv → activation(s)/dropout → Linear/conv`` runs in nn.Sequential."""
    for seq_name, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (up_name, up) in enumerate(children):
            if not isinstance(up, _LAYER):
                continue
            j, activated = i + 1, False
            while j < len(children) and isinstance(children[j][1], (*_ACTIVATIONS, *_PASS_THROUGH)):
                activated |= isinstance(children[j][1], _ACTIVATIONS)
                j += 1
            down = children[j][1] if activated and j < len(children) else None
            same_kind = isinstance(down, nn.Linear) if isinstance(up, nn.Linear) else type(down) is type(up)
            if same_kind and getattr(down, "groups", 1) == 1 and down.weight.shape[1] == up.weight.shape[0]:
                yield (f"{seq_name}.{up_name}" if seq_name else up_name), up, down


def _submodule(model: nn.Module, path: str, entry: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as err:
        raise ValueError(f"ReDoMonitor layer_map[{entry!r}]: the model has no module {path!r} ({err})") from err


def find_neuron_layers(model: nn.Module, layer_map: Mapping | None = None, exclude: Sequence[str] | None = None
                       ) -> list[NeuronLayer]:
    """The layers of neurons ReDo watches in ``model``.

    ``layer_map`` (``{name: (up | [gate, up], down)}`` by module names) is used as given.
    Otherwise: every block with ``neuron_layouts()`` (our GPT's MLPs), then every
    ``Linear/conv → activation → Linear/conv`` run inside an ``nn.Sequential``, keeping only
    layers whose incoming weights ``select_targets`` accepts (no positional blocks, no output
    head, minus ``exclude`` patterns on parameter names). The output layer is never an ``up``.
    """
    head = output_head(model)
    layers: list[NeuronLayer] = []
    if layer_map:
        for name, (incoming, down_name) in layer_map.items():
            names = [incoming] if isinstance(incoming, str) else list(incoming)
            modules = [_submodule(model, n, name) for n in [*names, down_name]]
            if head is not None and any(n == head for n in names):
                raise ValueError(f"ReDoMonitor layer_map[{name!r}]: {head!r} is the output layer, which ReDo never recycles")
            gate, up = (modules[0], modules[1]) if len(names) == 2 else (None, modules[0])
            _check_pair(name, up, modules[-1], gate)
            layers.append(NeuronLayer(name, up, modules[-1], gate))
        return layers

    allowed = {id(t.module) for t in select_targets(model, exclude=exclude, include_conv=True)}
    covered: set[int] = set()
    for name, module in model.named_modules():
        layouts = getattr(module, "neuron_layouts", None)
        if not callable(layouts):
            continue
        found = list(layouts())
        for i, layout in enumerate(found):  # by attribute: NeuronLayout may grow fields
            up, down, gate, offset = layout.up, layout.down, layout.gate, getattr(layout, "down_offset", 0)
            covered.update({id(up), id(down)})
            if id(up) in allowed and (gate is None or id(gate) in allowed):
                label = name if len(found) == 1 else f"{name}.{i}" if name else str(i)
                _check_pair(label, up, down, gate, offset)
                layers.append(NeuronLayer(label, up, down, gate, offset))
    for name, up, down in _sequential_pairs(model):
        if id(up) in allowed and id(up) not in covered and name != head:
            layers.append(NeuronLayer(name, up, down))
    return layers


class ReDoMonitor(L.Callback):
    """Dormant-neuron statistics, logging and (optionally) recycling, after Sokar et al. (ICML 2023).

    **Finds** the neuron layers itself (see :func:`find_neuron_layers`): our GPT's MLPs through
    ``neuron_layouts()``, ``Linear/conv → activation → Linear/conv`` runs in ``nn.Sequential``, or
    an explicit ``layer_map``. Raises a ValueError in ``setup`` when it finds none.

    **Collects** in ``on_train_batch_start``/``on_train_batch_end`` of every
    ``collect_every_n_steps``-th training step (never in validation): a forward pre-hook on
    each ``down`` layer reads the neuron values as they enter it — ``relu(c_fc x)²`` for relu²,
    ``act(c_gate x) * c_fc x`` for SwiGLU/GeGLU, the activation's output in a plain MLP/CNN — so
    no activation is re-implemented in the hook (the seed hooked ``c_fc``'s output and applied
    relu² itself; the input of ``c_proj`` is the same tensor). The mean ``|h|`` over batch and
    time/space updates an EMA per neuron (``lerp_``, weight ``1 - ema_decay``; a neuron's first
    observation, and its first after recycling, replaces the EMA). No host sync on this path.

    **Logs** in ``on_train_batch_end`` every ``log_every_n_steps`` optimizer steps:
    ``redo/dormant[/layer]`` (fraction with score ≤ ``tau``) and ``redo/dead[/layer]`` (τ = 0).
    A neuron that stops firing counts as dead at τ = 0 only once its EMA has decayed below ~1e-8
    of the layer mean (≈ 175 collections at ``ema_decay=0.9``): a lagging indicator by design.

    **Recycles** (off unless ``recycle_every_n_steps`` is set) in ``on_train_batch_end`` at optimizer
    steps that are multiples of it within ``[start_step, end_step]``: ``dormancy.reinit_incoming``
    (every layer first, then ``dormancy.zero_outgoing``, the reference's order) re-samples the
    τ-dormant neurons' incoming rows (``init="init_std"``: ``N(0, σ)`` with σ the
    layer's weight std recorded at the start of fit, i.e. its own init scale), zeroes their biases,
    outgoing columns and the optimizer moments of exactly those slices, and logs
    ``redo/recycled[/layer]``. The output head's units are never recycled.

    **DDP**: the EMA is all-reduced (mean) before every log or recycle decision and written back,
    so all ranks decide alike and a checkpoint holds the global statistics; re-sampled weights come
    from a generator seeded from ``(seed, global_step, layer)`` and are identical on every rank.
    Sharded strategies are refused in ``setup``. Hooks are removed in ``on_fit_end``/``teardown``;
    EMA, counters and recorded init scales are kept in ``state_dict``.

    Example:
        >>> redo = ReDoMonitor(tau=0.025, recycle_every_n_steps=1000)
        >>> trainer = L.Trainer(callbacks=[redo], max_steps=10_000)
        >>> trainer.fit(module, datamodule)   # logs redo/dormant, redo/dead, redo/recycled
    """

    def __init__(
        self,
        tau: float = 0.025,
        collect_every_n_steps: int = 10,
        log_every_n_steps: int = 100,
        ema_decay: float = 0.9,
        recycle_every_n_steps: int | None = None,
        start_step: int = 0,
        end_step: int | None = None,
        init: str = "init_std",
        layer_map: Mapping | None = None,
        exclude: Sequence[str] | None = None,
        plot_scores: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        check_number("tau", tau, 0.0, 1.0, "(0 = exactly dead; ReDo uses 0.025 or 0.1)")
        check_int("collect_every_n_steps", collect_every_n_steps)
        check_int("log_every_n_steps", log_every_n_steps)
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0 <= ema_decay < 1:
            raise ValueError(f"ema_decay={ema_decay!r} must be a number in [0, 1)")
        check_int("recycle_every_n_steps", recycle_every_n_steps, optional=True, hint="(None = no recycling)")
        check_int("start_step", start_step, minimum=0)
        check_int("end_step", end_step, minimum=start_step, optional=True, hint="(start_step)")
        if init not in CALLBACK_INITS:
            raise ValueError(f"init={init!r} is not one of {CALLBACK_INITS}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed={seed!r} must be an integer")
        validate_patterns(exclude=exclude)
        self.layer_map = _validate_layer_map(layer_map)
        self.tau, self.ema_decay, self.init = float(tau), float(ema_decay), init
        self.collect_every_n_steps, self.log_every_n_steps = collect_every_n_steps, log_every_n_steps
        self.recycle_every_n_steps, self.start_step, self.end_step = recycle_every_n_steps, start_step, end_step
        self.exclude, self.plot_scores, self.seed = list(exclude) if exclude else None, plot_scores, seed

        self.layers: list[NeuronLayer] = []
        self.collections = 0  # training batches whose activations entered the EMA
        self.last_logged_step = -1
        self.last_recycled_step = -1
        self._ema: torch.Tensor | None = None  # flat over layers: EMA of mean |h| per neuron
        self._observed: torch.Tensor | None = None  # per neuron: seen since fit start or its recycling
        self._recycled: torch.Tensor | None = None  # neurons recycled so far, per layer
        self._init_std: torch.Tensor | None = None  # (layers, 2): weight std of up and gate at fit start
        self._pending_state: dict | None = None
        self._hooks: list = []
        self._collecting = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(tau=self.tau, collect=self.collect_every_n_steps,
                                        recycle=self.recycle_every_n_steps, layers=sorted(self.layer_map or {}))

    # ------------------------------------------------------------------ setup and teardown
    def setup(self, trainer, pl_module, stage: str) -> None:
        require_full_parameters(trainer, "ReDoMonitor")
        self.layers = find_neuron_layers(pl_module, self.layer_map, self.exclude)
        if not self.layers:
            raise ValueError(
                "ReDoMonitor found no neuron layers: it looks for modules with neuron_layouts() (our GPT MLPs) and "
                "nn.Sequential runs Linear/conv → activation → Linear/conv outside the output head. Pass "
                "layer_map={name: (up_or_[gate, up], down)} with module names for other architectures.")

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._ema is None:
            device = self.layers[0].up.weight.device
            total = sum(layer.width for layer in self.layers)
            self._ema = torch.zeros(total, device=device)
            self._observed = torch.zeros(total, dtype=torch.bool, device=device)
            self._recycled = torch.zeros(len(self.layers), dtype=torch.long, device=device)
            with torch.no_grad():  # the layers' own init scale, unless a checkpoint restores the one recorded
                self._init_std = torch.stack([_init_stds(layer) for layer in self.layers])
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
        self._remove_hooks()
        offset = 0
        for index, layer in enumerate(self.layers):
            view = slice(offset, offset + layer.width)
            offset += layer.width
            self._hooks.append(layer.down.register_forward_pre_hook(functools.partial(self._collect, index, view)))
        rank_zero_info(f"ReDoMonitor watches {len(self.layers)} layers: {', '.join(l.name for l in self.layers)}")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._remove_hooks()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._collecting = False

    # ------------------------------------------------------------------ collection (hot path)
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._collecting = trainer.global_step % self.collect_every_n_steps == 0
        self.collections += int(self._collecting)

    @torch.no_grad()
    def _collect(self, index: int, view: slice, module: nn.Module, args) -> None:
        if not (self._collecting and module.training):  # e.g. another callback's eval forward inside the step
            return
        h = args[0].detach()
        layer = self.layers[index]
        unit = layer.neuron_dim(h)
        if h.shape[unit] != layer.width:  # one of several layers feeding slices of the same down
            h = h.narrow(unit, layer.down_offset, layer.width)
        weight = torch.where(self._observed[view], 1.0 - self.ema_decay, 1.0)  # a first observation replaces
        self._ema[view].lerp_(mean_abs_activation(h, unit), weight)
        self._observed[view].fill_(True)

    # ------------------------------------------------------------------ decisions
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._collecting = False
        step = trainer.global_step
        log_now = step % self.log_every_n_steps == 0 and step != self.last_logged_step
        recycle_now = (self.recycle_every_n_steps is not None and step % self.recycle_every_n_steps == 0
                       and step != self.last_recycled_step and step >= self.start_step
                       and (self.end_step is None or step <= self.end_step))
        if self.collections == 0 or not (log_now or recycle_now) or step == 0:
            return
        scores = self.scores(trainer)  # the one all-reduce: every rank decides on the same numbers
        if log_now:
            self.last_logged_step = step
            self._log_fractions(pl_module, scores)
        if recycle_now:
            self.last_recycled_step = step
            self._recycle(trainer, pl_module, self.dormant_masks(scores, self.tau), step)

    def scores(self, trainer=None) -> dict[str, torch.Tensor]:
        """Score per neuron for each layer. With ``trainer`` under DDP the statistics are first averaged
        over ranks (a collective: call it on every rank); without, this process's statistics."""
        if self._ema is None:
            return {}
        self._ema.copy_(all_reduce_mean(trainer, self._ema.clone()))
        return {layer.name: dormancy_scores(part) for layer, part in zip(self.layers, self._split(self._ema))}

    def dormant_masks(self, scores: dict[str, torch.Tensor], tau: float) -> dict[str, torch.Tensor]:
        """τ-dormant neurons per layer, among those observed since fit start or their recycling
        (a layer whose forward never ran in training has no statistics, not dead neurons)."""
        observed = dict(zip(scores, self._split(self._observed)))
        return {name: dormant_mask(s, tau) & observed[name] for name, s in scores.items()}

    def _split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(flat, [layer.width for layer in self.layers])

    def _log_fractions(self, pl_module, scores: dict[str, torch.Tensor]) -> None:
        total = sum(layer.width for layer in self.layers)
        for key, tau in (("dormant", self.tau), ("dead", 0.0)):
            counts = {name: mask.sum() for name, mask in self.dormant_masks(scores, tau).items()}
            for layer in self.layers:
                pl_module.log(f"redo/{key}/{layer.name}", counts[layer.name] / layer.width, on_step=True, on_epoch=False)
            pl_module.log(f"redo/{key}", sum(counts.values()) / total, on_step=True, on_epoch=False)

    def _recycle(self, trainer, pl_module, masks: dict[str, torch.Tensor], step: int) -> None:
        offset, counts = 0, []
        for index, layer in enumerate(self.layers):
            init = (self._init_std[index, 0], self._init_std[index, 1]) if self.init == "init_std" else self.init
            generator = rank_identical_generator(self.seed, step, index, device=layer.up.weight.device)
            counts.append(reinit_incoming(layer.up, masks[layer.name], layer.gate, init, trainer.optimizers, generator))
        # Outgoing weights only after every re-initialization (the reference's order): where one layer's
        # down is the next one's up, a weight joining two recycled neurons ends at 0, not re-sampled.
        for index, layer in enumerate(self.layers):
            mask, count = masks[layer.name], counts[index]
            zero_outgoing(layer.down, mask, trainer.optimizers, layer.down_offset)
            # A recycled neuron is a new neuron: its next observation replaces its EMA.
            self._observed[offset:offset + layer.width].masked_fill_(mask, False)
            offset += layer.width
            pl_module.log(f"redo/recycled/{layer.name}", count.float(), on_step=True, on_epoch=False)
        counts = torch.stack(counts)
        self._recycled += counts
        pl_module.log("redo/recycled", counts.sum().float(), on_step=True, on_epoch=False)

    # ------------------------------------------------------------------ figure
    def on_train_end(self, trainer, pl_module) -> None:
        if not self.plot_scores or self.collections == 0:
            return
        scores = self.scores(trainer)  # collective: on every rank
        if trainer.global_rank == 0:
            from ..core.figures import save_figure
            import matplotlib.pyplot as plt

            fig, axes = plt.subplots(len(scores), 1, figsize=(6, 1.8 * len(scores)), squeeze=False)
            for ax, (name, s) in zip(axes[:, 0], scores.items()):
                ax.hist(s.cpu().numpy(), bins=50)
                ax.axvline(self.tau, color="red", linestyle="--", label=f"tau={self.tau}")
                ax.set_title(name, fontsize=8)
            axes[-1, 0].set_xlabel("dormancy score (1 = layer mean)")
            axes[0, 0].legend(fontsize=7)
            fig.tight_layout()
            save_figure(fig, trainer, f"redo_scores_step{trainer.global_step}")

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        if self._ema is None:
            return dict(self._pending_state or {})
        return {"layers": [l.name for l in self.layers], "widths": [l.width for l in self.layers],
                "ema": self._ema.detach().cpu().clone(), "observed": self._observed.cpu().clone(),
                "recycled": self._recycled.cpu().clone(), "init_std": self._init_std.cpu().clone(),
                "collections": self.collections, "last_logged_step": self.last_logged_step,
                "last_recycled_step": self.last_recycled_step}

    def load_state_dict(self, state_dict: dict) -> None:
        if not state_dict:
            return
        self._pending_state = dict(state_dict)
        if self._ema is not None:  # strategies that restore after on_fit_start
            self._apply_state(self._pending_state)

    def _apply_state(self, state: dict) -> None:
        names, widths = [l.name for l in self.layers], [l.width for l in self.layers]
        if state["layers"] != names or state["widths"] != widths:
            raise ValueError(f"ReDoMonitor checkpoint watched layers {list(zip(state['layers'], state['widths']))}, "
                             f"this model has {list(zip(names, widths))}")
        self._ema.copy_(state["ema"])
        self._observed.copy_(state["observed"])
        self._recycled.copy_(state["recycled"])
        self._init_std = state["init_std"].to(self._ema.device)
        self.collections = state["collections"]
        self.last_logged_step, self.last_recycled_step = state["last_logged_step"], state["last_recycled_step"]
        self._pending_state = None


def _init_stds(layer: NeuronLayer) -> torch.Tensor:
    """``[std(up.weight), std(gate.weight)]`` (the gate's is up's when there is no gate), on device."""
    gate = layer.up if layer.gate is None else layer.gate
    return torch.stack([layer.up.weight.detach().float().std(), gate.weight.detach().float().std()])


def _validate_layer_map(layer_map) -> dict | None:
    """``{name: (up | [gate, up], down)}`` with module names; Hydra's DictConfig/ListConfig accepted."""
    if layer_map is None:
        return None
    error = ValueError(f"layer_map={layer_map!r} must map a name to (up_name | [gate_name, up_name], down_name)")
    if not isinstance(layer_map, Mapping) or not layer_map:
        raise error
    clean = {}
    for name, entry in layer_map.items():
        if isinstance(entry, str) or not isinstance(entry, Sequence) or len(entry) != 2:
            raise error
        incoming, down = entry
        incoming = [incoming] if isinstance(incoming, str) else list(incoming) if isinstance(incoming, Sequence) else None
        if not incoming or len(incoming) > 2 or not all(isinstance(n, str) for n in [*incoming, down]):
            raise error
        clean[str(name)] = (incoming[0] if len(incoming) == 1 else incoming, down)
    return clean
