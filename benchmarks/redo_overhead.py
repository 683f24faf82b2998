"""Training-step time of the default GPT with ReDoMonitor collecting statistics vs without.

One fit of ``GPTConfig()`` on batches shaped like ``configs/data/stdlib.yaml`` (16 × 256
tokens). Steps cycle through three modes, so machine noise hits all of them alike:

- ``baseline``: ReDoMonitor's collectors detached (as if it were not attached);
- ``idle``: collectors attached but not collecting (the other 9 of 10 steps at the default interval);
- ``collect``: collecting (every step with ``collect_every_n_steps=1``).

Each mode is compared with the baseline step of its own cycle; the overheads are medians of
those per-cycle ratios. At the default interval the cost is ``(9·idle + collect) / 10``.
On a shared CPU the per-cycle ratios scatter by several percent, so the script prints a
bootstrap interval of each median ratio, and times the collection's own work directly on the
activations of one step (collecting: reduction and EMA update; idle: an early return) divided
by the median baseline step.

    python benchmarks/redo_overhead.py [--cycles 20] [--budget-s 170] [--threads 1] [--clock cpu]

Goal: overhead <= 3% collecting every step, <= 0.5% at the default interval.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import GPTConfig, GPTLightningModule, ReDoMonitor

MODES = ("collect", "baseline", "idle")  # step % 3 == 0 collects (collect_every_n_steps=3)
WARMUP = 3  # one first cycle, not timed: optimizer state allocation, allocator warm-up


class CycleDriver(L.Callback):
    """Times each step and detaches/reattaches ReDo's hooks so steps cycle through MODES.

    Uses ReDoMonitor's own ``on_fit_end`` (removes hooks) and ``on_fit_start`` (re-registers them,
    keeping its statistics) — the same calls Lightning makes around a fit.
    """

    def __init__(self, redo: ReDoMonitor, budget_s: float, clock=time.perf_counter):
        self.redo, self.budget_s, self.clock = redo, budget_s, clock
        self.times: dict[str, list[float]] = {m: [] for m in MODES}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mode = MODES[trainer.global_step % 3]
        if mode == "baseline":
            self.redo.on_fit_end(trainer, pl_module)
        elif mode == "idle":
            self.redo.on_fit_start(trainer, pl_module)
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self._mode, self._start = mode, self.clock()
        if trainer.global_step == 0:
            self._began = time.perf_counter()  # the budget is wall time, whichever clock times the steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        if trainer.global_step > WARMUP:
            self.times[self._mode].append(self.clock() - self._start)
        if self._mode == "idle" and time.perf_counter() - self._began > self.budget_s:
            trainer.should_stop = True  # end on a complete cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20, help="timed cycles of (collect, baseline, idle) steps")
    parser.add_argument("--budget-s", type=float, default=170.0, help="stop earlier, after a complete cycle")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = leave as is)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time, robust when other jobs share the cores (use --threads 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(0, verbose=False)
    config = GPTConfig()
    module = GPTLightningModule(config, {"schedule": "constant"})
    steps = WARMUP + 3 * args.cycles
    tokens = torch.randint(0, 256, (args.batch_size * steps, config.sequence_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    redo = ReDoMonitor(collect_every_n_steps=3, log_every_n_steps=10**9)  # no log step inside the timing
    driver = CycleDriver(redo, args.budget_s, time.process_time if args.clock == "cpu" else time.perf_counter)
    trainer = L.Trainer(accelerator=args.device, devices=1, max_steps=steps, callbacks=[driver, redo], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, loader)

    direct = time_hooks_directly(redo, module, loader, clock=driver.clock)
    cycles = min(len(v) for v in driver.times.values())
    base = driver.times["baseline"][:cycles]
    ratio = {m: [t / b for t, b in zip(driver.times[m][:cycles], base)] for m in MODES}
    overhead = {m: statistics.median(r) - 1 for m, r in ratio.items()}
    print(f"GPT {config.n_layer}x{config.n_embd} {config.mlp}, batch {args.batch_size}x{config.sequence_len}, "
          f"{args.device}, {torch.get_num_threads()} threads, {cycles} cycles, {args.clock} clock")
    print(f"{'mode':<34}{'median step ms':>15}{'overhead vs baseline':>22}")
    for m in ("baseline", "idle", "collect"):
        print(f"{m:<34}{statistics.median(driver.times[m][:cycles]) * 1e3:>15.1f}{100 * overhead[m]:>+21.2f}%")
    default = (9 * overhead["idle"] + overhead["collect"]) / 10
    print(f"{'every step (collect_every_n_steps=1)':<49}{100 * overhead['collect']:>+21.2f}%  (goal <= 3%)")
    print(f"{'default interval (every 10 steps)':<49}{100 * default:>+21.2f}%  (goal <= 0.5%)")
    spread = statistics.quantiles(ratio["collect"], n=4) if cycles >= 4 else []
    if spread:
        print(f"collect/baseline per-cycle ratio quartiles: {', '.join(f'{q:.3f}' for q in spread)}")
        for m in ("idle", "collect"):
            lo, hi = bootstrap_median_interval(ratio[m])
            print(f"{m}/baseline median ratio, 90% bootstrap interval: [{lo:.3f}, {hi:.3f}]")
    step = statistics.median(base)
    print(f"direct: collection work per step {direct['collect'] * 1e3:.2f} ms collecting, {direct['idle'] * 1e6:.1f} us idle "
          f"({len(redo.layers)} layers)")
    every, default = direct["collect"] / step, (direct["collect"] + 9 * direct["idle"]) / 10 / step
    print(f"{'direct, every step':<49}{100 * every:>+21.2f}%  (goal <= 3%)")
    print(f"{'direct, default interval (every 10 steps)':<49}{100 * default:>+21.2f}%  (goal <= 0.5%)")


@torch.no_grad()
def time_hooks_directly(redo: ReDoMonitor, module, loader, reps: int = 20, clock=time.perf_counter) -> dict[str, float]:
    """Seconds per training step spent in ReDo's collection, collecting and idle, on real activations.
    Records what each MLP hands its ``hidden_observer`` in one forward, then calls ReDo's own
    collection (``_collect``) on those tensors."""
    module.train()
    redo.on_fit_start(None, module)  # attaches the collectors
    observed = [block for block in module.modules() if getattr(block, "hidden_observer", None) is not None]
    collectors = [block.hidden_observer for block in observed]
    inputs = []
    for block in observed:
        block.hidden_observer = lambda b, h: inputs.append((b, h))
    module(next(iter(loader))[0].to(module.device))
    result = {}
    for mode in ("collect", "idle"):
        redo._collecting = mode == "collect"
        times = []
        for _ in range(reps):
            start = clock()
            for collector, (block, h) in zip(collectors, inputs):
                collector(block, h)
            if module.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(clock() - start)
        result[mode] = statistics.median(times)
    redo.on_fit_end(None, module)
    return result


def bootstrap_median_interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float]:
    """90% bootstrap interval of the median of per-cycle ratios: is an overhead within noise?"""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples)]


if __name__ == "__main__":
    main()
