"""``AdaptiveSVDSwitch``: compare successive SVDs of each weight and switch it between full-matrix
and minor-component training (an adaptive MiLoRA)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import lightning as L
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from ..arguments import build_options, check_bool, check_int
from ..distributed import sharded_subspace
from ..distributed.sharded_state import load_named
from ..distributed.strategy import gather_full, is_dtensor
from ..functional.subspace import as_matrix
from ..functional.switch_cycle import (
    SubspaceMemory, SVDOptions, SwitchThresholds, matrix_cycle, padded, require_finite,
)
from ..model_map import Selection, WeightView, require_targets, select_targets
from ..model_map.weights import stored_param
from ..ops import factorization
from ..ops.minor_gradient import MIN_ENTRIES, GradientTap, compiled, tappable
from ..ops.optimizer_state import reset_optimizer_state
from .base import PlasticityCallback
from .figures import can_draw, save_figure
from .schedule import Schedule


@dataclass(kw_only=True)
class _Matrix(SubspaceMemory):
    """One target matrix: its weight view, its cycle-to-cycle subspace (:class:`SubspaceMemory`) and its tap."""

    target: WeightView
    attr: str  # parameter name on target.module ("weight", "in_proj_weight")
    expert: int | None = None  # which matrix of an expert stack (target.stack > 0) this is; None: the whole weight
    U_minor_whole: torch.Tensor | None = None  # FSDP2, transposed view: every row of U's minor columns (see place)
    tap: GradientTap | None = None  # single device: the projected gradient computed in the backward
    tap_checked: bool | None = None  # the tap's check: None not yet, True it matched ∇W, False plain projection
    tap_verdict: bool | None = None  # this step's check so far (on_after_backward), applied at its optimizer step
    _minor: tuple | None = None  # (U_prev, r, contiguous U_m) last built

    @property
    def name(self) -> str:
        """The weight's name; an expert's matrix is ``<stack>[e]``."""
        return self.target.name if self.expert is None else f"{self.target.name}[{self.expert}]"

    def oriented(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like the stored parameter) as this matrix's ``(out, in·∏k)``: for an expert, its own
        block of the stack's ``(E·out, in)`` view (the layout the model map reports, however it is stored)."""
        matrix = as_matrix(self.target.oriented(tensor))
        if self.expert is None:
            return matrix
        return matrix.unflatten(0, (self.target.stack, -1))[self.expert]

    def read(self) -> torch.Tensor:
        """The effective weight as ``(out, in·∏k)``, detached."""
        matrix = as_matrix(self.target.read())
        return matrix if self.expert is None else matrix.unflatten(0, (self.target.stack, -1))[self.expert]

    def project_(self, tensor: torch.Tensor | None) -> None:
        """``T ← U_m U_mᵀ T`` for this matrix's part of ``tensor`` (a gradient or a moment, stored layout)."""
        if tensor is None:
            return
        if self.expert is None:
            factorization.project_onto(tensor.transpose(0, 1) if self.target.transposed else tensor, self.U_minor)
        else:
            factorization.project_stack_(tensor, self.target, {self.expert: self.U_minor})

    @property
    def U_minor(self) -> torch.Tensor:
        """The minor columns of ``U``; under FSDP2 this rank's rows of them, or all of them for a transposed view.
        Contiguous and built once per SVD: every projected step reads them."""
        if self.U_minor_whole is not None:
            return self.U_minor_whole
        if self._minor is None or self._minor[0] is not self.U_prev or self._minor[1] != self.r:
            U = self.U_prev.to_local() if is_dtensor(self.U_prev) else self.U_prev
            self._minor = (self.U_prev, self.r, U[:, self.g - self.r:].contiguous())
        return self._minor[2]

    def place(self, trainer: L.Trainer) -> None:
        """Under FSDP2 keep ``U`` split by rows like the weight (a ``Shard(0)`` DTensor), and for a transposed view
        (HF ``Conv1D``, whose shards hold whole columns of the ``(out, in)`` view) its minor columns whole on every
        rank, which the projection of a column needs. What a checkpoint gave is placed here: a whole ``U`` (each
        rank keeps its rows) or the name of the rows each rank wrote into a distributed checkpoint."""
        from torch.distributed.tensor import Shard, distribute_tensor

        weight = self.target.param
        if not is_dtensor(weight) or self.U_prev is None or is_dtensor(self.U_prev):
            return
        device = weight.to_local().device
        self.S_prev = self.S_prev.to(device)
        if isinstance(self.U_prev, str):  # its rows in the distributed checkpoint being resumed
            empty = torch.empty(self.target.shape[0], self.g, dtype=self.S_prev.dtype, device=device)
            template = distribute_tensor(empty, weight.device_mesh, [Shard(0)], src_data_rank=None)
            self.U_prev = load_named(trainer, {self.U_prev: template}, "AdaptiveSVDSwitch singular vectors")[
                self.U_prev]
        else:  # src_data_rank=None: every rank holds the same loaded U and keeps its rows, no communication
            self.U_prev = distribute_tensor(self.U_prev.to(device), weight.device_mesh, [Shard(0)], src_data_rank=None)
        if self.target.transposed and self.state == "minor":
            self.U_minor_whole = self.U_prev[:, self.g - self.r:].full_tensor()


class AdaptiveSVDSwitch(PlasticityCallback):
    """Switch each weight between full-matrix and minor-component training (MiLoRA-style), decided by SVDs.

    When: ``schedule`` (:class:`~callbacks.schedule.Schedule`; step triggers only, the
    decision needs the step's gradient; default ``Schedule(every_n_steps=100, start_step=100)``). At
    each SVD cycle, for each target matrix: SVD, compare with the previous SVD, measure the
    gradient's alignment, decide whether the next phase trains the full matrix (state ``"full"``)
    or only its ``r`` minor components (state ``"minor"``), and with which ``r``.

    Hooks: ``on_train_batch_start`` asks the schedule and ``act`` marks the step for a cycle (so a
    factorized matrix captures the step's gradient over every micro-batch),
    ``on_before_optimizer_step`` runs the cycle on the step's (all-reduced) gradient, so no gradient is lost at a switch; between cycles it projects the gradients of
    ``"minor"`` matrices (``minor_training="project"``). ``on_fit_start`` follows the parameters FSDP2
    sharded after ``setup`` and rebuilds a factorized structure from a checkpoint; ``on_save_checkpoint`` writes plain weights (``W_p + BA``) into
    the checkpoint's model state, so it loads with or without this callback; ``on_train_end``
    saves a figure of the state and r per matrix.

    Changes: ``minor_training="project"`` replaces the gradients of ``"minor"`` matrices by
    ``U_m U_mᵀ ∇W`` (and projects their linear momentum at each cycle); on a single device a minor ``nn.Linear``
    or HF ``Conv1D`` weight gets that gradient straight from the backward, without its full gradient, and its
    ``requires_grad`` is off meanwhile (``skip_full_gradient``; as found again at the end of the fit). Its
    ``.grad`` is then projected before any ``on_before_optimizer_step``: a term another callback adds there
    (L2Init's pull) is not projected, whatever the callbacks' order. ``"factorize"``
    re-parametrizes them as frozen ``W_p`` + trainable ``B @ A`` and adds ``B, A`` to the weight's
    optimizer param group (see :mod:`plasticity_callbacks.ops.factorization`); every cycle
    folds ``BA`` back and re-splits with the new ``r``. Factorize runs on a single device only.

    An expert stack (a 3-D ``(E, out, in)`` parameter, or any weight the model map reports as a stack of ``E``
    matrices) is ``E`` matrices, ``<name>[e]``: each expert its own SVD, state, ``r`` and projection of its block of
    the gradient and moments (``minor_training="project"``, on one process or under DDP).

    Under FSDP2 (``ModelParallelStrategy`` with ``fully_shard``; ``minor_training="project"``) the result is
    the one process's on the same global batch. At a cycle each matrix, its gradient and its previous ``U``
    are gathered, one matrix at a time; one rank (round robin over the matrices) computes the SVD and the
    decision and shares them, so every rank acts on the same vectors (``U`` scattered by rows). Peak extra
    memory per rank at a cycle:
    those three gathered copies of one matrix, plus, on the rank computing it, its SVD and ``decide_mode``'s
    temporaries: 8 to 9 copies of the largest matrix in all (``benchmarks/adaptive_svd_fsdp.py``; 5 to 7
    when every rank holds the matrix, as under DDP). Between cycles each rank keeps its own rows of ``U``
    (a transposed view such as HF ``Conv1D``: also all rows of its ``r`` minor columns), and a step's
    projections cost one all-reduce of an ``r × d_in`` matrix per row-sharded minor matrix, coalesced into one
    (:mod:`~distributed.sharded_subspace`). In a distributed checkpoint each rank writes its
    rows of every ``U`` (a one-file checkpoint: each ``U`` gathered in turn into rank 0's CPU memory); at
    resume each rank reads its rows back.

    Logs ``adaptive_svd/<matrix>/{angle,principal_alignment,minor_alignment,reconstruction_error,
    effective_rank,r,minor}`` and ``adaptive_svd/{n_minor,mean_*}``; with warm-started cycles (``SVDOptions.warm``)
    ``adaptive_svd/{warm_fallbacks,warm_spectrum_starts}``, and ``effective_rank`` only where the cycle's trailing
    spectrum determines it.

    Args:
        minor_training: how a ``"minor"`` matrix trains: ``project`` (gradient projection; DDP and FSDP2)
            or ``factorize`` (``W_p + B @ A``, single device).
        schedule: when to run an SVD cycle (a Schedule or a mapping of its fields; step triggers only).
        selection: which weights (:class:`~model_map.Selection` or a mapping;
            conv kernels as ``(out, in·∏k)`` matrices); None: every weight but the head.
        thresholds: when a matrix switches (:class:`SwitchThresholds` or a mapping of its fields).
        svd: how the SVDs are computed (:class:`SVDOptions` or a mapping of its fields).
        r_min: fewest minor components.
        initial_rank: ``r`` of the first cycle (None: from the spectrum's gap / 99.9 % energy / g//2).
        log_per_matrix: also log the diagnostics per matrix.
        save_figure: save the state and r per matrix as a figure at the end of training.
        skip_full_gradient: on a single device (eager), compute a minor ``nn.Linear``/HF ``Conv1D`` weight's
            projected gradient ``U_m U_mᵀ ∇W`` in the backward from the layer's input and output gradient,
            so the full weight gradient is never formed (:mod:`~ops.minor_gradient`;
            each weight is checked against its full gradient once first): ``"auto"`` for weights of at least
            ``MIN_ENTRIES`` (2¹⁵) entries, where it saves time, True for all, False never (always project
            the full gradient after the backward). The trained weights are the same either way.

    Raises:
        ValueError: a bad argument; at setup, a selection that finds no weight, only rank-1 weights, grouped
            transposed convolutions, or expert stacks under ``minor_training="factorize"``.
        MisconfigurationException: ``minor_training="factorize"`` under any strategy but a single device; at
            setup, FSDP1 or DeepSpeed (flat shards), or expert stacks sharded by FSDP2, with the fix.
        FloatingPointError: a weight with NaN or Inf at an SVD cycle.

    Example:
        >>> switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(every_n_steps=100, start_step=200))
        >>> trainer = L.Trainer(max_steps=2000, callbacks=[switch])
        >>> trainer.fit(module, datamodule=data)
    """

    supports_fsdp2 = True  # minor_training="project": distributed.sharded_subspace
    quick_settings = {"schedule": {"every_n_steps": 2, "start_step": 2}, "r_min": 2,  # act within 4 steps
                      "thresholds": {"clobber_alignment": 0.0}, "save_figure": False}
    summary_metrics = ("adaptive_svd/n_minor",)
    reads_gradients = True  # its alignments read the last step's gradient
    default_schedule = Schedule(every_n_steps=100, start_step=100)
    extra_state_types = {"matrices": dict, "history": list}
    # FSDP2: each matrix's U, sharded by rows; the warm cycles' counts (absent from runs saved before they were kept)
    optional_state_types = {"singular_vectors": list, "warm_counts": list}
    parameter_state_keys = ("singular_vectors",)

    def __init__(
        self,
        minor_training: str = "project",
        schedule: Schedule | Mapping | None = None,
        selection: Selection | Mapping | None = None,
        thresholds: SwitchThresholds | Mapping | None = None,
        svd: SVDOptions | Mapping | None = None,
        r_min: int = 8,
        initial_rank: int | None = None,
        log_per_matrix: bool = True,
        save_figure: bool = True,
        skip_full_gradient: bool | str = "auto",
    ):
        if minor_training not in factorization.MINOR_TRAINING:
            raise ValueError(f"minor_training={minor_training!r} is not one of {factorization.MINOR_TRAINING}")
        super().__init__(schedule, Selection.build(selection, self.owner))
        self.schedule.require_step_triggers(self.owner, "decides on the step's gradient")
        check_int("r_min", r_min)
        check_int("initial_rank", initial_rank, optional=True)
        self.thresholds = build_options(SwitchThresholds, thresholds or {}, self.owner, "thresholds")
        self.svd = build_options(SVDOptions, svd or {}, self.owner, "svd")
        self.minor_training = minor_training
        self._cycle_now = False  # the schedule said so at this step's first batch
        self._capturing = False  # factorized weights carry their gradient probes (a cycle step)
        self.r_min, self.initial_rank = r_min, initial_rank
        check_bool("log_per_matrix", log_per_matrix)
        check_bool("save_figure", save_figure)
        self.log_per_matrix, self.save_figure = log_per_matrix, save_figure
        if skip_full_gradient not in (True, False, "auto"):
            raise ValueError(f"skip_full_gradient={skip_full_gradient!r} is not one of True, False, 'auto'")
        self.skip_full_gradient = skip_full_gradient
        self._taps_on = False  # this fit taps minor Linear/Conv1D weights (ops.minor_gradient)
        self._taps_stale = True  # the matrices' states changed since the taps were last placed
        self._backward_seen = False  # on_after_backward ran since the last optimizer step (Lightning's backward)
        self.matrices: list[_Matrix] = []
        self.history: list[tuple[int, str, str, int]] = []  # (step, matrix, state, r) per decision
        self._pending: dict | None = None  # loaded state, applied once the targets exist
        self.warm_cycles = self.warm_fallbacks = 0  # the run's warm-started SVDs, and those that fell back
        self.warm_spectrum_starts = 0  # the run's warm cycles that started from a wide weight's spectrum

    @property
    def state_key(self) -> str:
        return self._generate_state_key(minor_training=self.minor_training,
                                        **asdict(self.selection))

    # ---------------------------------------------------------------- setup and resume
    def check_strategy(self, trainer: L.Trainer) -> None:
        super().check_strategy(trainer)
        if self.minor_training == "factorize" and not isinstance(trainer.strategy, SingleDeviceStrategy):
            raise MisconfigurationException(
                f"AdaptiveSVDSwitch(minor_training='factorize') changes the parameter set during training, which "
                f"{type(trainer.strategy).__name__} cannot follow after wrapping the model (the new factors would "
                "be neither sharded nor gradient-synchronized). Use minor_training='project' (same minor-subspace "
                "training by gradient projection, DDP- and FSDP2-safe) or a single device."
            )

    def check_targets(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.matrices:
            return
        targets = require_targets(select_targets(pl_module, self.selection), "AdaptiveSVDSwitch", self.selection)
        grouped_transposed = [t.name for t in targets if t.transposed and t.groups > 1]
        if grouped_transposed:
            raise ValueError(f"AdaptiveSVDSwitch: {grouped_transposed} are grouped transposed convolutions, whose "
                             "(out, in) matrix is not a view of the stored kernel; exclude them "
                             "(selection={'exclude': [...]})")
        stacks = [t.name for t in targets if t.stack]
        if stacks and self.minor_training == "factorize":  # a parametrization replaces the whole parameter
            raise ValueError(f"AdaptiveSVDSwitch(minor_training='factorize'): {stacks} are stacks of expert matrices, "
                             "which it cannot re-parametrize one expert at a time; use minor_training='project' (each "
                             "expert its own SVD and projection) or exclude them (selection={'exclude': "
                             + repr(sorted({_stack_pattern(n) for n in stacks})) + "})")
        for t in targets:
            if t.stack:  # each expert's matrix on its own: one SVD of the (E·out, in) stack would mix their subspaces
                out, inputs = t.shape[0] // t.stack, math.prod(t.shape[1:])
                if min(out, inputs) >= 2:
                    self.matrices += [_Matrix(target=t, attr=t.attribute, g=min(out, inputs), expert=e)
                                      for e in range(t.stack)]
                continue
            g = min(as_matrix(t.read()).shape)  # (out, in) orientation: HF Conv1D is transposed
            if g >= 2:  # a rank-1 shape has nothing to split
                self.matrices.append(_Matrix(target=t, attr=t.name.rsplit(".", 1)[-1], g=g))
        if not self.matrices:
            raise ValueError(f"AdaptiveSVDSwitch: every selected weight ({[t.name for t in targets]}) has rank 1 at "
                             "most, so there is no minor subspace to switch to; select larger matrices")
        self._apply_pending()

    def extra_state(self) -> dict:
        matrices = {}
        for m in self.matrices:
            # FSDP2: U (each rank's rows) goes to "singular_vectors", which on_save_checkpoint writes shard by shard
            U = None if is_dtensor(m.U_prev) else m.U_prev
            entry = {"state": m.state, "r": m.r, "U_prev": U, "S_prev": m.S_prev, "tap_checked": m.tap_checked,
                     "warm_start": m.warm_start, "V_prev": m.V_prev}
            if factorization.is_factorized(m.target.module, m.attr):
                parts = factorization.components(m.target.module, m.attr)
                entry.update(W_p=m.target.param.detach().clone(), B=parts.B.detach().clone(),
                             A=parts.A.detach().clone())
            matrices[m.name] = entry
        state = {"matrices": matrices, "history": list(self.history),
                 "warm_counts": [self.warm_cycles, self.warm_fallbacks, self.warm_spectrum_starts]}
        if any(is_dtensor(m.U_prev) for m in self.matrices):  # replaced, never changed in place: no copy needed
            state["singular_vectors"] = [m.U_prev if is_dtensor(m.U_prev) else None for m in self.matrices]
        return state

    def load_extra_state(self, state: dict) -> None:
        self._pending = state
        self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is None or not self.matrices:
            return
        saved = self._pending["matrices"]
        # FSDP2: each U is a whole tensor, or a name in the distributed checkpoint (placed at first use)
        sharded = dict(zip(saved, self._pending.get("singular_vectors") or [None] * len(saved)))
        for m in self.matrices:
            entry = saved.get(m.name)
            if entry is not None:
                U = entry["U_prev"] if sharded.get(m.name) is None else sharded[m.name]
                m.state, m.r, m.U_prev, m.S_prev = entry["state"], entry["r"], U, entry["S_prev"]
                m.tap_checked = entry.get("tap_checked")
                m.warm_start = entry.get("warm_start", "previous")  # a run saved before the hint existed: the default
                m.V_prev = entry.get("V_prev")  # a tall weight's warm start; absent before: its next cycle is full
        self.history = [tuple(h) for h in self._pending["history"]]
        # the logged counts run over the whole run, so a resumed run logs what an unbroken one would
        self.warm_cycles, self.warm_fallbacks, self.warm_spectrum_starts = self._pending.get("warm_counts", (0, 0, 0))

    def attach(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._follow_sharded_parameters()
        sharded_stacks = sorted({m.target.name for m in self.matrices if m.expert is not None
                                 and is_dtensor(m.target.param)})
        if sharded_stacks:  # its sharded cycle splits one matrix by rows, not a stack by experts
            raise MisconfigurationException(
                f"AdaptiveSVDSwitch: {sharded_stacks} are expert stacks sharded by FSDP2, whose per-expert SVD cycle "
                "runs on one process or under DDP only; exclude them (selection={'exclude': "
                + repr(sorted({_stack_pattern(n) for n in sharded_stacks})) + "}) or train with DDP")
        # Runs after configure_optimizers and before Lightning loads the optimizer state, so the
        # factors re-join their groups in the saved order and their moments load into them.
        if self._pending is None or self.minor_training != "factorize":
            return
        saved = self._pending["matrices"]
        for m in self.matrices:
            entry = saved.get(m.name, {})
            if "B" in entry and not factorization.is_factorized(m.target.module, m.attr):
                device = m.target.param.device
                parts = factorization.factorize(m.target.module, m.attr, entry["B"].to(device), entry["A"].to(device),
                                                frozen=entry["W_p"].to(device), transposed=m.target.transposed)
                factorization.attach(trainer.optimizers, m.target.param, [parts.B, parts.A])
        self._pending = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        """The model state gets the plain effective weight; ``W_p, B, A`` live in this callback's state. FSDP2:
        each rank writes its rows of every ``U`` into the distributed checkpoint (a one-file checkpoint: each
        ``U`` gathered in turn into rank 0's CPU memory), see :mod:`~distributed.sharded_state`."""
        super().on_save_checkpoint(trainer, pl_module, checkpoint)  # parameter_state_keys: the rows of each U
        state = checkpoint.get("state_dict")
        if state is None:
            return
        for m in self.matrices:
            if factorization.is_factorized(m.target.module, m.attr):
                prefix = m.target.name[: -len(m.attr)]
                for key in [k for k in state if k.startswith(f"{prefix}parametrizations.{m.attr}.")]:
                    del state[key]
                state[m.target.name] = getattr(m.target.module, m.attr).detach().clone()

    def _follow_sharded_parameters(self) -> None:
        """Point each view at its module's parameter now: FSDP2's ``fully_shard`` (``configure_model``, after
        ``setup``) replaces every parameter with a sharded DTensor one."""
        for m in self.matrices:
            param = stored_param(m.target.module, m.target.attribute)
            if param is not None and param is not m.target.param:
                m.target = dataclasses.replace(m.target, param=param)

    # ---------------------------------------------------------------- training
    def act(self, trainer, pl_module, reason: str) -> dict[str, float]:
        self._cycle_now = True  # the cycle needs the step's gradient: it runs in on_before_optimizer_step
        return {}

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # The tap changes requires_grad, which DDP's reducer and FSDP2 do not follow, and adds forward hooks,
        # which a compiled forward ignores: a single eager device only; elsewhere the gradient is projected.
        self._taps_on = (self.skip_full_gradient is not False and self.minor_training == "project"
                         and isinstance(trainer.strategy, SingleDeviceStrategy) and not compiled(pl_module))
        self._taps_stale = True
        if self.skip_full_gradient is True and not self._taps_on:  # asked for explicitly: say why it is not done
            why = ("minor_training='factorize' trains B, A instead" if self.minor_training != "project" else
                   f"{type(trainer.strategy).__name__} does not follow a change of requires_grad"
                   if not isinstance(trainer.strategy, SingleDeviceStrategy) else
                   "the model runs through torch.compile, which does not see hooks added later")
            rank_zero_warn(f"AdaptiveSVDSwitch(skip_full_gradient=True) has no effect here: {why}; minor gradients "
                           "are formed whole and projected after the backward (the same training, without the saving)")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._taps_on:
            if self._cycle_now:
                self._remove_taps()  # the cycle reads the full gradient
            elif self._taps_stale:
                self._place_taps()
        capture = self._cycle_now
        if self.minor_training == "project" or capture == self._capturing:
            return  # nothing factorized, or the probes already as this step needs them (a loop costs every step)
        self._capturing = capture
        for m in self.matrices:
            if factorization.is_factorized(m.target.module, m.attr):
                factorization.components(m.target.module, m.attr).capture = capture

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._cycle_now:
            self._cycle_now = False
            self.log_event(trainer, self._cycle(trainer, pl_module))
        elif self.minor_training == "project":
            sharded, stacks = [], {}
            for m in self.matrices:
                if m.state != "minor":
                    continue
                if m.expert is not None:  # a stack's minor experts, projected together (one view of the stack)
                    stacks.setdefault(id(m.target.param), (m.target, {}))[1][m.expert] = m.U_minor
                elif is_dtensor(m.target.param):
                    m.place(trainer)
                    if m.target.param.grad is not None:  # FSDP2 leaves a gradient None on every rank alike
                        sharded.append((m.target.param.grad, m.U_minor, m.target.transposed))
                elif m.tap is None or not m.tap.skips_full_gradient:  # else projected in the backward
                    if m.tap is not None and m.tap.installed and m.tap_checked is None:
                        self._check_tap(m, trainer)
                    factorization.project_gradient(m.target.param, m.U_minor, m.target.transposed)
            if sharded:
                sharded_subspace.project_sharded_(sharded)  # one all-reduce for all row-sharded matrices
            for target, projections in stacks.values():
                if target.param.grad is not None:
                    factorization.project_stack_(target.param.grad, target, projections)
        self._backward_seen = False
        super().on_before_optimizer_step(trainer, pl_module, optimizer)

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The taps' check reads the gradients as the backward left them: before an AMP scaler unscales the
        # weights' (not C's) and before other callbacks add to them in on_before_optimizer_step.
        if self._taps_on:
            self._backward_seen = True
            for m in self.matrices:
                if m.tap is not None and m.tap.installed and m.tap_checked is None:
                    m.tap_verdict = m.tap.verdict()  # sums so far: the last backward of the step decides

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._remove_taps()  # the user's model back as it was: every weight with its own gradient, no hooks
        super().teardown(trainer, pl_module, stage)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_taps()
        super().on_exception(trainer, pl_module, exception)

    # ---------------------------------------------------------------- projected gradients in the backward
    def _place_taps(self) -> None:
        """Tap each "minor" trainable Linear/Conv1D weight whose tap did not fail its check (ops.minor_gradient)."""
        self._remove_taps()  # every requires_grad as the user left it
        smallest = MIN_ENTRIES if self.skip_full_gradient == "auto" else 0
        for m in self.matrices:
            if (m.state == "minor" and m.tap_checked is not False and m.target.param.requires_grad
                    and tappable(m.target.module, m.target.param, smallest)):
                m.tap = m.tap or GradientTap(m.target.param, m.target.module, m.target.transposed)
                m.tap.install(m.U_minor, m.tap_checked)
        self._taps_stale = False

    def _remove_taps(self) -> None:
        for m in self.matrices:
            if m.tap is not None and m.tap.installed:
                m.tap.remove()
                self._taps_stale = True

    def _check_tap(self, m: _Matrix, trainer: L.Trainer) -> None:
        """The end of a tap's checking step: its projection against the full gradient's (on_after_backward)."""
        verdict, m.tap_verdict = m.tap_verdict, None
        if not self._backward_seen:  # a manual-optimization loss.backward(): no on_after_backward, check here
            scaler = getattr(trainer.precision_plugin, "scaler", None)  # it unscaled W.grad, not C.grad
            verdict = m.tap.verdict(scale=float(scaler.get_scale()) if scaler is not None else 1.0)
        m.tap.restart_check()
        if verdict is None:
            return  # no gradient this step, or an overflow: check at the next one
        m.tap_checked, self._taps_stale = verdict, True
        if not verdict:
            rank_zero_warn(f"AdaptiveSVDSwitch: {m.name!r} gets gradient from more than its "
                           f"{type(m.target.module).__name__}'s forward (a tied weight, or code reading it "
                           "directly), so its minor phases project the full gradient after the backward rather "
                           "than computing the projection in it: the same training, without the saved time")

    @torch.no_grad()
    def _cycle(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        step, logged = trainer.global_step, []
        self._taps_stale = True  # states and U change: the next step places the taps again
        for index, m in enumerate(self.matrices):
            module, weight = m.target.module, m.target.param
            if is_dtensor(weight):
                logged.append((m, self._sharded_cycle(trainer, m, index, step)))
                continue
            factorized = factorization.is_factorized(module, m.attr)
            W = m.read()  # the effective weight in either structure, (out, in) orientation
            require_finite(W, m.name, step)  # one sync per SVD cycle, which syncs anyway
            grad = factorization.components(module, m.attr).captured if factorized else weight.grad
            grad = m.oriented(grad) if grad is not None else None
            svd, new_state, r_next, diag = self._decide(m, W, grad, m.U_prev, step, warm=True)
            m.state, m.r, m.U_prev, m.S_prev = new_state, r_next, svd.U, padded(svd.S, m.g)
            m.V_prev = svd.V if W.shape[0] > W.shape[1] else None  # (d_in, d_in): every method gives a tall V whole
            if self.minor_training == "project":
                if new_state == "minor":
                    for tensor in [weight.grad, *factorization.linear_moments(trainer.optimizers, weight)]:
                        m.project_(tensor)
            else:
                self._resplit(trainer, m, svd, grad, factorized)
            self.history.append((step, m.name, new_state, r_next))
            logged.append((m, diag))
        if self.minor_training == "factorize":  # factors in target order, whether re-split in place or appended
            parts = [factorization.components(m.target.module, m.attr) for m in self.matrices
                     if factorization.is_factorized(m.target.module, m.attr)]
            factorization.order_in_groups(trainer.optimizers, [p for part in parts for p in (part.B, part.A)])
        return self._metrics(logged)

    def _sharded_cycle(self, trainer: L.Trainer, m: _Matrix, index: int, step: int) -> dict:
        """One matrix's cycle under FSDP2 (``minor_training="project"``), on every rank: the weight, its gradient and
        the previous ``U`` gathered (this matrix alone), the SVD and decision computed by one rank
        (:func:`~distributed.sharded_subspace.owner_of`, round robin) and shared, so every rank
        holds the same decision and the same vectors; then the gradient and linear moments projected."""
        weight = m.target.param
        m.place(trainer)
        W = as_matrix(m.target.oriented(gather_full(weight)))  # (out, in·∏k), the same on every rank
        require_finite(W, m.name, step)  # the same W everywhere: every rank raises alike
        owner, dtype = sharded_subspace.owner_of(index, weight), self.svd.torch_dtype
        keys = ("subspace_angle", "principal_alignment", "minor_alignment", "reconstruction_error", "effective_rank")
        numbers = torch.zeros(2 + len(keys), dtype=torch.float64, device=W.device)  # minor?, r_next, diagnostics
        U_prev = gather_full(m.U_prev) if m.U_prev is not None else None
        grad = gather_full(weight.grad) if weight.grad is not None else None
        svd = failure = None
        if sharded_subspace.is_owner(index, weight):
            try:
                grad = as_matrix(m.target.oriented(grad)) if grad is not None else None
                svd, state, r_next, diag = self._decide(m, W, grad, U_prev, step)
                numbers.copy_(torch.tensor([state == "minor", r_next, *(diag[k] for k in keys)], dtype=torch.float64))
            except Exception as error:  # told to the other ranks, which would wait for the result forever
                failure, numbers[0] = error, -1
        del W, grad, U_prev  # the gathered copies: one matrix's worth at a time
        sharded_subspace.broadcast_from(owner, numbers, weight)
        if numbers[0] < 0:
            if failure is not None:
                raise failure
            raise RuntimeError(f"AdaptiveSVDSwitch: rank {owner} of the data-parallel mesh failed in the SVD cycle "
                               f"of {m.target.name!r} at step {step}; its own error says why")
        S = sharded_subspace.broadcast_from(owner, svd.S.to(dtype) if svd is not None else
                                            torch.empty(m.g, dtype=dtype, device=numbers.device), weight)
        m.U_prev = sharded_subspace.scatter_rows_from(owner, svd.U if svd is not None else None, weight,
                                                      (m.target.shape[0], m.g), dtype)
        m.state, m.r, m.S_prev = ("minor" if numbers[0] else "full"), int(numbers[1]), S
        m.U_minor_whole = None
        if m.target.transposed and m.state == "minor":  # one all-gather of (d_out, r)
            m.U_minor_whole = m.U_prev[:, m.g - m.r:].full_tensor()
        if self.minor_training == "project" and m.state == "minor":
            moments = [(moment, m.U_minor, m.target.transposed)
                       for moment in factorization.linear_moments(trainer.optimizers, weight)]
            grads = [(weight.grad, m.U_minor, m.target.transposed)] if weight.grad is not None else []
            sharded_subspace.project_sharded_(grads + moments)
        self.history.append((step, m.name, m.state, m.r))
        return dict(zip(keys, numbers[2:].tolist()))

    def _decide(self, m: _Matrix, W: torch.Tensor, grad: torch.Tensor | None, U_prev: torch.Tensor | None,
                step: int, warm: bool = False) -> tuple:
        """One matrix's SVD and decision, ``(svd, state, r_next, diagnostics)`` (:func:`~functional.switch_cycle.
        matrix_cycle`), its warm starts counted: on one process, and on the rank computing it under FSDP2 (``W``,
        ``grad`` and ``U_prev`` whole, ``(out, in)``). ``warm``: this caller stores an ``S`` of any length (the
        sharded cycle broadcasts ``g`` values)."""
        cycle = matrix_cycle(m, W, grad, U_prev, step, self.svd, self.thresholds, self.r_min, self.initial_rank,
                             right_vectors=self.minor_training == "factorize", warm=warm)  # V shapes only a split
        self.warm_cycles += cycle.warm
        self.warm_fallbacks += cycle.fallback
        self.warm_spectrum_starts += cycle.spectrum_start
        return cycle.svd, cycle.state, cycle.r_next, cycle.diagnostics

    def _resplit(self, trainer, m: _Matrix, svd, grad, factorized: bool) -> None:
        """Fold ``BA`` back if factorized, then split again with the new ``r`` if "minor". The
        step's gradient ``G`` w.r.t. the effective weight moves to the new structure by the chain
        rule (``∇B = G Aᵀ``, ``∇A = Bᵀ G``), so the coming optimizer step is not lost."""
        module, weight = m.target.module, m.target.param
        if factorized and m.state == "minor" and factorization.components(module, m.attr).B.shape[1] == m.r:
            # Same rank: new factors in place, so a compiled model keeps its graph (no new module class).
            B, A = factorization.minor_factors(svd, m.r, weight.dtype)
            parts = factorization.resplit(module, m.attr, B, A)
            reset_optimizer_state(trainer.optimizers, [parts.B, parts.A])
            if grad is not None:
                G = as_matrix(grad).to(B.dtype)
                parts.B.grad, parts.A.grad = G @ parts.A.mT, parts.B.mT @ G
            return
        if factorized:
            parts = factorization.components(module, m.attr)
            factorization.detach(trainer.optimizers, [parts.B, parts.A])
            factorization.fold(module, m.attr)
        if m.state == "minor":
            B, A = factorization.minor_factors(svd, m.r, weight.dtype)
            parts = factorization.factorize(module, m.attr, B, A, transposed=m.target.transposed)
            if grad is not None:
                G = as_matrix(grad).to(B.dtype)
                parts.B.grad, parts.A.grad = G @ parts.A.mT, parts.B.mT @ G
            factorization.attach(trainer.optimizers, weight, [parts.B, parts.A])
        else:
            # ``grad`` is (out, in): back to the stored orientation
            weight.grad = (m.target.oriented(grad.reshape(m.target.shape)).to(weight.dtype).contiguous()
                           if grad is not None else None)

    def _metrics(self, logged: list) -> dict[str, float]:
        metrics = {}

        def log(name, value):
            metrics[f"adaptive_svd/{name}"] = float(value)

        keys = ("principal_alignment", "minor_alignment", "reconstruction_error")
        for m, diag in logged:
            if self.log_per_matrix:
                name = m.name
                if not math.isnan(diag["subspace_angle"]):  # no previous SVD yet: nothing to compare
                    log(f"{name}/angle", diag["subspace_angle"])
                for key in keys:
                    log(f"{name}/{key}", diag[key])
                if not math.isnan(diag["effective_rank"]):  # a warm cycle may not know it (tail_energy_rank)
                    log(f"{name}/effective_rank", diag["effective_rank"])
                log(f"{name}/r", m.r)
                log(f"{name}/minor", m.state == "minor")
        log("n_minor", sum(m.state == "minor" for m, _ in logged))
        if self.warm_cycles:
            log("warm_fallbacks", self.warm_fallbacks)  # since the run began: warm starts that took the full SVD
            log("warm_spectrum_starts", self.warm_spectrum_starts)  # and those that started from a spectrum
        for key in keys:
            log(f"mean_{key}", sum(d[key] for _, d in logged) / len(logged))
        angles = [d["subspace_angle"] for _, d in logged if not math.isnan(d["subspace_angle"])]
        if angles:
            log("mean_angle", sum(angles) / len(angles))
        return metrics

    # ---------------------------------------------------------------- the end
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # the base's fit-end check of the schedule
        if not self.save_figure or not self.history or not can_draw("AdaptiveSVDSwitch", "save_figure"):
            return
        sizes = {m.name: m.g for m in self.matrices}
        path = save_figure(modes_figure(self.history, sizes), trainer, "adaptive_svd_modes")
        if path is not None:
            rank_zero_info(f"AdaptiveSVDSwitch: figure saved to {path}")


def modes_figure(history: list[tuple[int, str, str, int]], sizes: dict[str, int]):
    """One row per matrix, one column per SVD cycle: grey where the full matrix trains, coloured
    by ``r / g`` (with ``r`` written in the cell when the grid is small) where only the ``r``
    minor components of its ``g`` singular directions train.

    Args:
        history: ``(optimizer step, matrix name, state, r)`` per decision, as the callback records them.
        sizes: matrix name -> ``g`` (its number of singular values), in the rows' order.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state), ready for ``save_figure``.
    """
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    names = list(sizes)
    steps = sorted({step for step, *_ in history})
    share = np.full((len(names), len(steps)), np.nan)
    ranks = np.zeros_like(share, dtype=int)
    for step, name, state, r in history:
        row, column = names.index(name), steps.index(step)
        ranks[row, column] = r
        share[row, column] = r / sizes[name] if state == "minor" else np.nan
    colour = colormaps["viridis"].with_extremes(bad="0.85")
    fig = Figure(figsize=(min(14, 3.5 + 0.45 * len(steps)), 1.6 + 0.28 * len(names)), layout="constrained")
    ax = fig.subplots()
    # cell edges halfway between decision steps, so each cell spans the steps its decision governs
    edges = np.array([*steps, steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)], dtype=float)
    image = ax.pcolormesh(edges, np.arange(len(names) + 1), np.ma.masked_invalid(share), cmap=colour,
                          vmin=0, vmax=1, edgecolors="white", linewidth=0.5)
    if len(steps) <= 24 and len(names) <= 40:
        for row in range(len(names)):
            for column in range(len(steps)):
                if not np.isnan(share[row, column]):
                    ax.text((edges[column] + edges[column + 1]) / 2, row + 0.5, str(ranks[row, column]),
                            ha="center", va="center", fontsize=6, color="white" if share[row, column] < 0.5 else "k")
    ax.set_yticks(np.arange(len(names)) + 0.5, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("optimizer step (each cell: from one SVD cycle to the next)")
    ax.set_title("AdaptiveSVDSwitch: which matrices train only minor components, and how many", fontsize=10)
    fig.colorbar(image, ax=ax, label="minor state: r / g (number in the cell: r)", shrink=0.9)
    fig.legend([Patch(color="0.85")], ["full matrix trained"], loc="outside lower right", frameon=False, fontsize=8)
    return fig


def _stack_pattern(name: str) -> str:
    """An exclude pattern for every layer's copy of the stack ``name``: ``*.experts.gate_up_proj``."""
    parts = name.split(".")
    return "*." + ".".join(parts[-2:]) if len(parts) > 1 else name
