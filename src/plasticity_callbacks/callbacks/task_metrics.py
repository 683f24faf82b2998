"""``TaskMetrics``: plasticity measured at the end of every task of a task stream."""
from __future__ import annotations

import csv
import json
import time

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from ..core.arguments import check_int
from ..core.figures import run_output_dir
from ..functional.dormancy import dormancy_scores, mean_abs_activation
from ..functional.spectral import effective_rank, stable_rank

COLUMNS = ("task", "step", "accuracy", "loss", "dormant", "dead", "feature_rank", "stable_rank",
           "weight_norm", "grad_norm")


def plasticity_metrics(pl_module: L.LightningModule, x: torch.Tensor, y: torch.Tensor, tau: float) -> dict[str, float]:
    """Accuracy and loss on ``(x, y)``, and what the papers read plasticity from, on the same inputs:

    - ``dormant`` / ``dead``: share of hidden units (all ReLU layers; conv: channels) whose ReDo score
      ``E|h_i| / mean_k E|h_k|`` is ``≤ tau`` / exactly 0 (Sokar et al. 2023);
    - ``feature_rank``: effective rank (Roy & Vetterli) of the final hidden layer's features, ``(M, width)``
      (Kumar et al. 2021; Lyle et al. 2023), and ``stable_rank`` ``‖Φ‖²_F / ‖Φ‖²₂`` of the same matrix;
    - ``weight_norm``: the L2 norm of every parameter together (Dohare et al. 2024).

    The module must provide ``hidden_activations(x) -> [(name, tensor), ...]`` (last = final hidden layer).
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
    scores = torch.cat([dormancy_scores(mean_abs_activation(h, unit_dim=1)) for h in hidden])
    features = hidden[-1].flatten(1)  # (M, width)
    return {
        "accuracy": float((logits.argmax(-1) == y).float().mean()),
        "loss": float(F.cross_entropy(logits, y)),
        "dormant": float((scores <= tau).float().mean()),
        "dead": float((scores == 0).float().mean()),
        "feature_rank": float(effective_rank(features)),
        "stable_rank": float(stable_rank(features)),
        "weight_norm": float(torch.sqrt(sum(p.detach().float().square().sum() for p in pl_module.parameters()))),
    }


class TaskMetrics(L.Callback):
    """Measures plasticity at the end of every task of a task stream (:mod:`plasticity_callbacks.data.digits`).

    When: in ``on_train_batch_end`` of each task's last batch (global steps ``task_boundary_steps``
    and the end of the stream), before any method acts at the next boundary.
    What: :func:`plasticity_metrics` on the data module's ``eval_data(task)``, plus ``grad_norm``:
    the mean over the task's steps (every ``grad_norm_every_n_steps``-th) of the total gradient
    norm before clipping (``on_before_optimizer_step``). Logged with ``pl_module.log`` as ``task/<metric>`` (every task
    end must be a logging step: ``steps_per_task`` a multiple of ``trainer.log_every_n_steps``),
    kept in ``state_dict`` (a resumed run keeps its earlier tasks) and written at the end of
    training to ``<log dir>/tasks.csv`` (one row per task) and ``<log dir>/stream.json``
    (``method``, ``seed``, the stream's settings, training seconds).

    Args:
        tau: dormancy threshold of ``dormant`` (ReDo's 0.025).
        method: the name of the plasticity method under test, recorded in ``stream.json``.
        grad_norm_every_n_steps: steps between two gradient-norm samples (each costs a host sync).

    Example:
        >>> trainer = L.Trainer(max_epochs=1, callbacks=[TaskMetrics(method="fire")])
        >>> trainer.fit(DigitsClassifier(), datamodule=RandomLabelDigits(num_tasks=5))
    """

    def __init__(self, tau: float = 0.025, method: str | None = None, grad_norm_every_n_steps: int = 10):
        if not (isinstance(tau, (int, float)) and 0 <= tau < 1):
            raise ValueError(f"TaskMetrics tau={tau!r} must be in [0, 1)")
        check_int("grad_norm_every_n_steps", grad_norm_every_n_steps)
        self.tau, self.method, self.grad_every = float(tau), method, grad_norm_every_n_steps
        self.history: list[dict[str, float]] = []
        self.seconds = 0.0
        self._grad_norms: list[float] = []
        self._started: float | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        stream = trainer.datamodule
        if not all(hasattr(stream, a) for a in ("task_boundary_steps", "eval_data", "steps_per_task")):
            raise ValueError("TaskMetrics needs a task-stream data module (task_boundary_steps, steps_per_task, "
                             f"eval_data), got {type(stream).__name__}")
        if not callable(getattr(pl_module, "hidden_activations", None)):
            raise ValueError(f"TaskMetrics needs a module with hidden_activations(x), got {type(pl_module).__name__}")
        every = trainer.log_every_n_steps
        if every and stream.steps_per_task % every:
            raise ValueError(f"TaskMetrics: data.steps_per_task={stream.steps_per_task} is not a multiple of "
                             f"trainer.log_every_n_steps={every}; task ends would not reach the logger")

    def on_train_start(self, trainer, pl_module) -> None:
        self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step % self.grad_every:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self._grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        stream, step = trainer.datamodule, trainer.global_step
        if step not in stream.task_boundary_steps and step != stream.total_steps:
            return
        task = stream.task_at(step - 1)
        metrics = plasticity_metrics(pl_module, *stream.eval_data(task), self.tau)
        metrics["grad_norm"] = sum(self._grad_norms) / len(self._grad_norms) if self._grad_norms else float("nan")
        self._grad_norms = []
        pl_module.log_dict({f"task/{k}": v for k, v in metrics.items()} | {"task/index": float(task)})
        self.history.append({"task": task, "step": step, **metrics})
        rank_zero_info(f"task {task}: accuracy {metrics['accuracy']:.3f}, dormant {metrics['dormant']:.3f}, "
                       f"feature rank {metrics['feature_rank']:.1f}")

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
                "batch_size": stream.batch_size, "seconds": self.seconds}
        (base / "stream.json").write_text(json.dumps(info, indent=2) + "\n")

    def state_dict(self) -> dict:
        running = time.perf_counter() - self._started if self._started is not None else 0.0
        return {"history": list(self.history), "seconds": self.seconds + running, "grad_norms": list(self._grad_norms)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict["history"])
        self.seconds = float(state_dict["seconds"])
        self._grad_norms = list(state_dict["grad_norms"])
