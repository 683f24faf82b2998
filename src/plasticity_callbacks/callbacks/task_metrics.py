"""``TaskMetrics``: plasticity and stability measured over every task of a task stream."""
from __future__ import annotations

import csv
import json
import time
from contextlib import ExitStack, contextmanager
from typing import ClassVar

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from ..arguments import check_int
from ..distributed.strategy import all_reduce_mean, is_dtensor, require_full_parameters
from .figures import run_output_dir
from ..ops.minor_gradient import full_gradients
from ..distributed.sharded_state import reshard
from .base import register
from .step_logging import log_at_step
from ..functional.diagnostics import abs_activation_sum, feature_gram, gram_ranks, unit_fractions
from ..functional.dormancy import dormancy_scores
from ..data.tokenizer import IGNORE_INDEX

COLUMNS = ("task", "step", "accuracy", "loss", "online_accuracy", "online_loss", "retained_accuracy",
           "probe_accuracy", "dormant", "dead", "feature_rank", "stable_rank", "weight_norm", "grad_norm")


def target_scores(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accuracy (share of argmax hits) and mean cross-entropy over the targets that count.

    ``logits`` is ``(..., V)`` and ``targets`` ``(...)``: one label per sample (a classifier, ``(M, V)`` and
    ``(M,)``) or per position (a language model, ``(M, T, V)`` and ``(M, T)``); targets equal to
    ``IGNORE_INDEX`` (-100) are left out of both, as the training loss leaves them out.

    Example:
        >>> targets = torch.full((4, 16), -100)
        >>> targets[:, -1] = 7  # only the last position of each window counts
        >>> accuracy, loss = target_scores(torch.randn(4, 16, 264), targets)
    """
    logits, targets = logits.flatten(0, -2), targets.flatten()
    keep = targets != IGNORE_INDEX
    if not bool(keep.any()):
        raise ValueError("target_scores: every target is IGNORE_INDEX (-100); nothing to measure")
    logits, targets = logits[keep].float(), targets[keep]
    return (logits.argmax(-1) == targets).float().mean(), F.cross_entropy(logits, targets)


def plasticity_metrics(pl_module: L.LightningModule, x: torch.Tensor, y: torch.Tensor, tau: float) -> dict[str, float]:
    """Accuracy and loss on ``(x, y)`` (:func:`target_scores`: per sample or per position, ignored targets left
    out), and what the papers read plasticity from, on the same inputs:

    - ``dormant`` / ``dead``: share of hidden units (all ReLU layers; conv: channels) whose ReDo score
      ``E|h_i| / mean_k E|h_k|`` is ``≤ tau`` / 0 (Sokar et al. 2023);
    - ``feature_rank``: effective rank (Roy & Vetterli) of the final hidden layer's features, ``(M, width)``
      (Kumar et al. 2021; Lyle et al. 2023), and ``stable_rank`` ``‖Φ‖²_F / ‖Φ‖²₂`` of the same matrix;
    - ``weight_norm``: the L2 norm of every parameter together (Dohare et al. 2024).

    The module must provide ``hidden_activations(x) -> [(name, tensor), ...]`` (last = final hidden layer), each
    tensor ``(rows, units)`` or ``(rows, channels, ...)`` (a language model gives one row per sample and position).
    Under a distributed strategy every rank passes the same ``(x, y)`` (a forward under FSDP2 is a
    collective), so each computes one process's values; FSDP2 units are left on their shards.
    """
    was_training = pl_module.training
    pl_module.eval()
    try:
        with torch.no_grad():
            x, y = x.to(pl_module.device), y.to(pl_module.device)
            logits = pl_module(x)
            hidden = [h for _, h in pl_module.hidden_activations(x)]
    finally:
        pl_module.train(was_training)
        reshard(pl_module)  # FSDP2 leaves a root unit gathered after an evaluation: back to its shards
    # the same functions as PlasticityMonitor's (functional/diagnostics.py), on this evaluation's activations
    scores = torch.cat([dormancy_scores(abs_activation_sum(h, unit_dim=1) / (h.numel() // h.shape[1]))
                        for h in hidden])
    fractions = unit_fractions(scores, tau)
    ranks = gram_ranks(feature_gram(hidden[-1].flatten(1)))  # features (M, width)
    accuracy, loss = target_scores(logits, y)
    return {
        "accuracy": float(accuracy),
        "loss": float(loss),
        "dormant": float(fractions["dormant"]),
        "dead": float(fractions["dead"]),
        "feature_rank": float(ranks["effective_rank"]),
        "stable_rank": float(ranks["stable_rank"]),
        "weight_norm": total_norm([p.detach().float() for p in pl_module.parameters()]),
    }


def accuracy_on(pl_module: L.LightningModule, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``(x, y)`` the module classifies right, in eval mode, without gradients."""
    was_training = pl_module.training
    pl_module.eval()
    try:
        with torch.no_grad():
            logits = pl_module(x.to(pl_module.device))
    finally:
        pl_module.train(was_training)
        reshard(pl_module)
    return float(target_scores(logits, y.to(logits.device))[0])


@contextmanager
def evaluated_weights(trainer, pl_module: L.LightningModule):
    """The weights a method evaluates with, in ``pl_module`` while the block runs: every callback with an
    ``evaluation_weights(trainer, pl_module)`` context (HareTortoise: its tortoise) swaps them in, and back after.
    Without such a callback, the trained weights as they are.

    Example:
        >>> with evaluated_weights(trainer, pl_module):
        ...     metrics = plasticity_metrics(pl_module, x, y, tau=0.025)
    """
    with ExitStack() as stack:
        for callback in trainer.callbacks:
            if callable(getattr(callback, "evaluation_weights", None)):
                stack.enter_context(callback.evaluation_weights(trainer, pl_module))
        yield


def total_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` together; FSDP2's ``DTensor`` shards are combined over the ranks
    (a collective: call it on every rank)."""
    norm = torch.nn.utils.get_total_norm(tensors)
    return float(norm.full_tensor() if is_dtensor(norm) else norm)


def probe_accuracy(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> float:
    """Plasticity probe (Lyle et al. 2023): from the module's current weights, ``steps`` full-batch Adam
    steps (learning rate ``lr``, fresh moments) on ``(x, y)``; the accuracy reached on ``(x, y)``.

    The probe trains the module itself, then puts back exactly what it changed: every trainable
    parameter, every buffer and every ``.grad``. Under FSDP2 (``DTensor`` parameters) this acts on each
    rank's shards: every rank feeds the same ``(x, y)``, FSDP averages identical gradients, and Adam is
    elementwise, so each rank's rows follow one process's probe, with no gathered copy of the model.
    Extra memory per rank: a copy of its parameter shards and buffers, and Adam's two moments of its
    shards. Call it on every rank under a distributed strategy (its forward and backward are collectives).

    Example:
        >>> probe_accuracy(pl_module, *stream.probe_data(), steps=50, lr=1e-3)   # module unchanged after
    """
    with full_gradients(module):  # AdaptiveSVD's gradient taps off: the probe trains every weight plainly
        return _train_probe(module, x, y, steps, lr)


def _train_probe(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float) -> float:
    reshard(module)  # FSDP2: an evaluation left the root unit gathered; its parameters are then not the shards
    params = [p for p in module.parameters() if p.requires_grad]
    saved_params = [p.detach().clone() for p in params]
    saved_grads = [p.grad for p in params]
    buffers = list(module.buffers())
    saved_buffers = [b.detach().clone() for b in buffers]
    device = next(module.parameters()).device
    x, y = x.to(device), y.to(device)
    try:
        for p in params:
            p.grad = None
        optimizer = torch.optim.Adam(params, lr=lr)
        with torch.enable_grad():
            for _ in range(steps):
                loss = target_scores(module(x), y)[1]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
        with torch.no_grad():
            logits = module(x)
        return float(target_scores(logits, y)[0])
    finally:
        reshard(module)  # the last forward left the root unit gathered with the probe's weights
        with torch.no_grad():
            for p, saved, grad in zip(params, saved_params, saved_grads):
                p.copy_(saved)
                p.grad = grad
            for b, saved in zip(buffers, saved_buffers):
                b.copy_(saved)


@register
class TaskMetrics(L.Callback):
    """Measures plasticity and stability over every task of a task stream (:mod:`plasticity_callbacks.data.digits`).

    When: over each task's steps (``on_train_batch_end``: the training batch's loss and accuracy) and
    at each task's last batch (global steps ``task_boundary_steps`` and the end of the stream), before
    any method acts at the next boundary. What, per task:

    - ``online_loss`` / ``online_accuracy``: mean over the task's steps of the training batch's loss and
      accuracy, each computed before that step's update (Dohare et al. 2024; Kumar et al. 2023). Needs a
      ``training_step`` that returns ``{"loss", "accuracy"}``; accuracy is NaN when it returns the loss only.
    - :func:`plasticity_metrics` on the data module's ``eval_data(task)`` (end-of-task ``accuracy`` etc.), on the
      network the method evaluates (:func:`evaluated_weights`: Hare & Tortoise's tortoise), as are the two below.
    - ``retained_accuracy`` (stability): mean accuracy on ``eval_data`` of the previous
      ``stability_tasks`` tasks (NaN for task 0).
    - ``probe_accuracy``: :func:`probe_accuracy` on the stream's ``probe_data()``, every
      ``probe_every_n_tasks`` tasks (NaN between them; ``probe_steps=0`` turns it off).
    - ``grad_norm``: the mean over the task's steps (every ``grad_norm_every_n_steps``-th) of the
      total gradient norm before clipping (``on_before_optimizer_step``).

    Logged as ``task/<metric>`` once, at the task end's global step, whatever ``trainer.log_every_n_steps``
    (:func:`~callbacks.step_logging.log_at_step`; the latest task's values stay in ``callback_metrics``),
    kept in ``state_dict`` (a resumed run keeps its earlier tasks) and written at the end of training to
    ``<log dir>/tasks.csv`` (one row per task) and ``<log dir>/stream.json`` (``method``, ``seed``, the
    stream's settings, its ``chance`` accuracy (null where it has none), training seconds).

    On several ranks (DDP, or FSDP2: Lightning's ``ModelParallelStrategy``) every number is one process's
    on the same stream: each rank trains on an equal share of every batch, so the online values are
    averaged over ranks each step; the end-of-task metrics run on the whole evaluation data on every rank
    (identical inputs, identical results: no reduction to get wrong, at the cost of repeating a small
    evaluation); norms combine FSDP2's shards; the probe trains the sharded module in place and restores it
    (:func:`probe_accuracy`), so no rank ever holds the whole model. FSDP1 and DeepSpeed are refused at setup.

    Args:
        tau: dormancy threshold of ``dormant`` (ReDo's 0.025).
        method: the name of the plasticity method under test, recorded in ``stream.json``.
        grad_norm_every_n_steps: steps between two gradient-norm samples (each costs a host sync).
        stability_tasks: how many previous tasks ``retained_accuracy`` averages over.
        probe_steps: full-batch Adam steps of the plasticity probe (0: no probe).
        probe_every_n_tasks: probe after tasks ``0, n, 2n, …`` and the last one.
        probe_lr: the probe's Adam learning rate.

    Example:
        >>> trainer = L.Trainer(max_epochs=1, callbacks=[TaskMetrics(method="fire", probe_steps=50)])
        >>> trainer.fit(DigitsClassifier(), datamodule=RandomLabelDigits(num_tasks=5))
    """

    supports_fsdp2: ClassVar[bool] = True  # norms and the probe on the shards

    def __init__(self, tau: float = 0.025, method: str | None = None, grad_norm_every_n_steps: int = 10,
                 stability_tasks: int = 3, probe_steps: int = 0, probe_every_n_tasks: int = 1,
                 probe_lr: float = 1e-3):
        if not (isinstance(tau, (int, float)) and 0 <= tau < 1):
            raise ValueError(f"TaskMetrics tau={tau!r} must be in [0, 1)")
        check_int("grad_norm_every_n_steps", grad_norm_every_n_steps)
        check_int("stability_tasks", stability_tasks)
        check_int("probe_steps", probe_steps, minimum=0)
        check_int("probe_every_n_tasks", probe_every_n_tasks)
        if not (isinstance(probe_lr, (int, float)) and probe_lr > 0):
            raise ValueError(f"TaskMetrics probe_lr={probe_lr!r} must be a positive number")
        self.tau, self.method, self.grad_every = float(tau), method, grad_norm_every_n_steps
        self.stability_tasks, self.probe_steps, self.probe_every, self.probe_lr = (
            stability_tasks, probe_steps, probe_every_n_tasks, float(probe_lr))
        self.history: list[dict[str, float]] = []
        self.seconds = 0.0
        self._grad_norms: list[float] = []
        self._online = [0.0, 0.0, 0]  # this task's sums of batch loss and accuracy, and its step count
        self._started: float | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        require_full_parameters(trainer, "TaskMetrics", fsdp2=self.supports_fsdp2)
        stream = trainer.datamodule
        if not all(hasattr(stream, a) for a in ("task_boundary_steps", "eval_data", "steps_per_task")):
            raise ValueError("TaskMetrics needs a task-stream data module (task_boundary_steps, steps_per_task, "
                             f"eval_data), got {type(stream).__name__}")
        if not callable(getattr(pl_module, "hidden_activations", None)):
            raise ValueError(f"TaskMetrics needs a module with hidden_activations(x), got {type(pl_module).__name__}")

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step % self.grad_every:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:  # DDP: already averaged over ranks; FSDP2: each rank's shard of the averaged gradient
            self._grad_norms.append(total_norm(grads))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._add_online(trainer, outputs)
        stream, step = trainer.datamodule, trainer.global_step
        if step not in stream.task_boundary_steps and step != stream.total_steps:
            return
        task = stream.task_at(step - 1)
        with evaluated_weights(trainer, pl_module):  # the network the method evaluates (Hare & Tortoise: the tortoise)
            metrics = plasticity_metrics(pl_module, *stream.eval_data(task), self.tau)
            earlier = range(max(0, task - self.stability_tasks), task)
            metrics["retained_accuracy"] = (sum(accuracy_on(pl_module, *stream.eval_data(j)) for j in earlier)
                                            / len(earlier)) if task else float("nan")
            probe_now = self.probe_steps and (task % self.probe_every == 0 or task == stream.num_tasks - 1)
            metrics["probe_accuracy"] = (probe_accuracy(pl_module, *stream.probe_data(), self.probe_steps,
                                                        self.probe_lr) if probe_now else float("nan"))
        loss_sum, accuracy_sum, steps = self._online
        metrics["online_loss"] = loss_sum / steps if steps else float("nan")
        metrics["online_accuracy"] = accuracy_sum / steps if steps else float("nan")
        metrics["grad_norm"] = sum(self._grad_norms) / len(self._grad_norms) if self._grad_norms else float("nan")
        self._grad_norms, self._online = [], [0.0, 0.0, 0]
        # measured at task ends only: written at this step, never repeated in the rows of the next task
        log_at_step(trainer, {f"task/{k}": v for k, v in metrics.items()} | {"task/index": float(task)})
        self.history.append({"task": task, "step": step, **metrics})
        rank_zero_info(f"task {task}: accuracy {metrics['accuracy']:.3f}, dormant {metrics['dormant']:.3f}, "
                       f"feature rank {metrics['feature_rank']:.1f}")

    def _add_online(self, trainer, outputs) -> None:
        """Add this step's training loss and accuracy (a host sync per step: tiny next to the step itself).
        On several ranks, each holds an equal share of the step's batch: the mean of their values is the
        whole batch's, and every rank keeps the same sums (a checkpoint saves rank 0's)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        accuracy = outputs.get("accuracy") if isinstance(outputs, dict) else None
        pair = torch.tensor([float(v) if v is not None else float("nan") for v in (loss, accuracy)],
                            device=trainer.strategy.root_device)
        loss_value, accuracy_value = all_reduce_mean(trainer, pair).tolist()
        self._online[0] += loss_value
        self._online[1] += accuracy_value
        self._online[2] += 1

    def on_train_end(self, trainer, pl_module) -> None:
        if self._started is not None:
            self.seconds += time.perf_counter() - self._started
            self._started = None
        self.write(trainer)

    @rank_zero_only
    def write(self, trainer) -> None:
        base = run_output_dir(trainer)
        if base is None:  # never into the current directory unasked
            rank_zero_warn("TaskMetrics: tasks.csv and stream.json not written: the trainer has no logger and its "
                           "default_root_dir is the current directory; pass L.Trainer(default_root_dir=...) or a "
                           "logger (TaskMetrics.history holds the rows)")
            return
        base.mkdir(parents=True, exist_ok=True)
        with (base / "tasks.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(self.history)
        stream = trainer.datamodule
        info = {"method": self.method, "seed": stream.seed, "stream": type(stream).__name__,
                "num_tasks": stream.num_tasks, "steps_per_task": stream.steps_per_task,
                "batch_size": stream.batch_size, "seconds": self.seconds, "stability_tasks": self.stability_tasks,
                "probe_steps": self.probe_steps, "chance": getattr(stream, "chance", None)}
        (base / "stream.json").write_text(json.dumps(info, indent=2) + "\n")

    def state_dict(self) -> dict:
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return {"history": list(self.history), "seconds": self.seconds + running, "grad_norms": list(self._grad_norms),
                "online": list(self._online)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])
        self.seconds = float(state_dict["seconds"])
        self._grad_norms = list(state_dict["grad_norms"])
        self._online = list(state_dict.get("online", [0.0, 0.0, 0]))
