"""Step-time overhead of DASHPeriodic (DASH's per-step rule) on the default GPT (``GPTConfig()``).

Three configurations are trained alternately, round after round, in one process: no callback,
the periodic rule at every step (``every_n_steps=1``), and at the default (2000). A short
run never reaches step 2000, so the default-interval overhead is reported two ways: measured
(the idle hook's cost per step) and amortized (one shrink event's cost / 2000, added to it).

    python benchmarks/dash_overhead.py [--rounds 3] [--steps 5] [--batch-size 4]
"""
from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import DASHPeriodic, GPTConfig, GPTLightningModule
from plasticity_callbacks.callbacks.schedule import Schedule


class StepTimer(L.Callback):
    """Wall time of each training batch (forward, backward, hooks, optimizer step), warm-up steps dropped."""

    def __init__(self, warmup: int):
        self.warmup, self.times, self._t0 = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)


class TimedDASH(DASHPeriodic):
    """DASHPeriodic whose hook records its own wall time (the shrink event cost, without step noise)."""

    hook_times: list[float]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        t0 = time.perf_counter()
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.hook_times.append(time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)

    config = GPTConfig()
    module = GPTLightningModule(config, {"schedule": "constant"})
    n = args.batch_size * (args.steps + args.warmup)
    tokens = torch.randint(0, 256, (n, config.sequence_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    n_params = sum(p.numel() for p in module.parameters())
    print(f"GPTConfig() defaults: {n_params:,} parameters, batch {args.batch_size}x{config.sequence_len}, "
          f"{args.threads} thread(s), {args.rounds} rounds x {args.steps} timed steps, alternating")

    # (every_n_steps, log_per_layer); per-layer logging is most of an event's cost (Lightning's log()).
    configs = {"none": None, "every step": (1, True), "every step, totals only": (1, False),
               "every 2000 (default)": (2000, True)}
    step_times = {name: [] for name in configs}
    hook_times = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, setting in configs.items():
            callbacks = [StepTimer(args.warmup)]
            if setting is not None:
                dash = TimedDASH(schedule=Schedule(every_n_steps=setting[0]), log_per_layer=setting[1])
                dash.hook_times = hook_times[name]
                callbacks.append(dash)
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps + args.warmup, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=callbacks)
            trainer.fit(module, loader)
            step_times[name].extend(callbacks[0].times)

    base = statistics.median(step_times["none"])
    print(f"\n{'configuration':<26} {'median step':>12} {'ratio':>8} {'hook/step':>10}")
    for name in configs:
        med = statistics.median(step_times[name])
        hook = statistics.median(hook_times[name]) if hook_times[name] else 0.0
        print(f"{name:<26} {med * 1e3:>10.2f}ms {med / base:>8.4f} {hook * 1e3:>8.3f}ms")
    event = statistics.median(hook_times["every step"])  # one full shrink event (cosines, multiply, logging)
    idle = statistics.median(hook_times["every 2000 (default)"])  # the hook on a step where it does not act
    amortized = (idle + event / 2000) / base
    print(f"\none shrink event: {event * 1e3:.3f} ms = {event / base:.2%} of a step")
    print(f"idle hook: {idle * 1e6:.1f} us per step")
    print(f"overhead at the default interval (idle hook + event/2000): {amortized:.4%} of a step (goal <= 1%)")


if __name__ == "__main__":
    main()
