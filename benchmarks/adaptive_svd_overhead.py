"""AdaptiveSVDSwitch overhead on the default GPT (``GPTConfig()``), measured side by side in one run.

Time: one ``trainer.fit`` whose steps are cut into segments of ``--interval`` steps; segments
rotate between no callback, the switch with ``svd={"method": "full"}`` and with ``"randomized"``, so each
switch segment holds exactly one SVD cycle plus ``interval − 1`` projected steps (every matrix is
forced into the "minor" state: the worst case for the per-step projection). Rotating keeps machine
noise common to all three; on a loaded machine the segment ratios still scatter by ±20%, so the
time spent inside the callback's hook, as a share of its segments, is printed as well. Memory: AdamW state bytes with every matrix factorized at rank r vs full.

    python benchmarks/adaptive_svd_overhead.py --rounds 2 --interval 100
    python benchmarks/adaptive_svd_overhead.py --direct-only      # CPU-time cost model only (minutes)

The direct cost model (first lines printed) times, in this process's CPU time, one SVD cycle and
one projected step inside the callback and a step without it, and combines them for the interval:
the figure that the goal (<= 5% at the default interval on the default 16x256 batch) is about.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import cpu_trainer, token_loader  # noqa: E402

from plasticity_callbacks import AdaptiveSVDSwitch, GPTLightningModule  # noqa: E402
from plasticity_callbacks.core.schedule import Schedule  # noqa: E402
from plasticity_callbacks.core.optimizer_state import leaf_optimizers  # noqa: E402

VARIANTS = ("none", "full", "randomized")


class Rotation(L.Callback):
    """Delegates to one switch (or none) per segment and times each segment."""

    def __init__(self, switches: dict, interval: int):
        self.switches, self.interval = switches, interval
        self.times = {v: [] for v in VARIANTS}
        self.inside = {v: 0.0 for v in VARIANTS}  # seconds spent in the switch's own hook (less noisy)
        self._started = None

    def variant(self, step: int) -> str:
        return VARIANTS[(step // self.interval) % len(VARIANTS)]

    def setup(self, trainer, pl_module, stage):
        for s in self.switches.values():
            s.setup(trainer, pl_module, stage)

    def on_train_start(self, trainer, pl_module):
        for s in self.switches.values():
            s.on_train_start(trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = trainer.global_step
        switch = self.switches.get(self.variant(step))
        if switch is not None:  # the switch asks its schedule here
            switch.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if step % self.interval == 0:
            if self._started is not None:
                self.times[self.variant(step - 1)].append(time.perf_counter() - self._started)
            self._started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        variant = self.variant(trainer.global_step)
        switch = self.switches.get(variant)
        if switch is not None:
            started = time.perf_counter()
            switch.on_before_optimizer_step(trainer, pl_module, optimizer)
            self.inside[variant] += time.perf_counter() - started


def time_overhead(rounds: int, interval: int, batch_size: int) -> None:
    L.seed_everything(0)
    module = GPTLightningModule({}, lr=1e-3, schedule="constant")
    common = dict(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=interval),
                  thresholds={"clobber_alignment": 0.0},
                  save_figure=False, log_per_matrix=False)
    switches = {"full": AdaptiveSVDSwitch(svd={"method": "full"}, **common),
                "randomized": AdaptiveSVDSwitch(svd={"method": "randomized"}, **common)}
    rotation = Rotation(switches, interval)
    steps = interval * len(VARIANTS) * rounds + 1  # the +1 closes the last segment
    n = steps * batch_size
    loader = token_loader(n=n, sequence_len=module.config.sequence_len, vocab=256, batch_size=batch_size)
    trainer = cpu_trainer(max_steps=steps, callbacks=[rotation])
    trainer.fit(module, loader)
    base = statistics.median(rotation.times["none"])
    print(f"time per {interval}-step segment (median of {rounds}), GPT {module.config.n_layer}x{module.config.n_embd}, "
          f"{len(switches['full'].matrices)} matrices, batch {batch_size}x{module.config.sequence_len}, "
          f"torch threads {torch.get_num_threads()}:")
    for v in VARIANTS:
        t = statistics.median(rotation.times[v])
        inside = rotation.inside[v] / sum(rotation.times[v])
        print(f"  {v:10s} {t:6.2f} s   ratio vs none {t / base:6.3f}   time inside the callback {inside:6.2%}   "
              f"segments {[round(x, 2) for x in rotation.times[v]]}")


class CostClock(L.Callback):
    """Per step: CPU time of the whole step and of the switch's hook inside it (cycle or projection)."""

    def __init__(self, switch: AdaptiveSVDSwitch):
        self.switch = switch
        self.steps: list[tuple[int, float, float]] = []  # (step, step seconds, hook seconds)

    def setup(self, trainer, pl_module, stage):
        self.switch.setup(trainer, pl_module, stage)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start, self._hook = time.process_time(), 0.0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        started = time.process_time()
        self.switch.on_before_optimizer_step(trainer, pl_module, optimizer)
        self._hook = time.process_time() - started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps.append((trainer.global_step - 1, time.process_time() - self._start, self._hook))


def amortized_overhead(batch_size: int, interval: int, cycles: int = 3, every: int = 4) -> None:
    """The switch's cost at ``interval``, from this process's CPU time (robust on shared cores):
    one SVD cycle plus ``interval − 1`` projected steps, over ``interval`` steps without the switch.
    Cycles run every ``every`` steps here so a short fit holds several; every matrix is forced low-rank."""
    L.seed_everything(0)
    module = GPTLightningModule({}, lr=1e-3, schedule="constant")
    switch = AdaptiveSVDSwitch(minor_training="project", schedule=Schedule(every_n_steps=every, start_step=every),
                               thresholds={"clobber_alignment": 0.0},
                               save_figure=False, log_per_matrix=False)
    clock = CostClock(switch)
    steps = every * (cycles + 1) + 1
    loader = token_loader(n=steps * batch_size, sequence_len=module.config.sequence_len, vocab=256,
                          batch_size=batch_size)
    cpu_trainer(max_steps=steps, callbacks=[clock]).fit(module, loader)
    timed = [s for s in clock.steps if s[0] > every]  # after the first cycle: every matrix is low-rank
    cycle = statistics.median(h for step, _, h in timed if step % every == 0)
    project = statistics.median(h for step, _, h in timed if step % every)
    base = statistics.median(t - h for _, t, h in timed)
    share = (cycle + (interval - 1) * project) / (interval * base)
    print(f"direct CPU-time cost, batch {batch_size}x{module.config.sequence_len}, {len(switch.matrices)} matrices: "
          f"step without the switch {1e3 * base:.0f} ms, SVD cycle {1e3 * cycle:.0f} ms, projection "
          f"{1e3 * project:.1f} ms/step -> {100 * share:.2f}% of step time every {interval} steps (goal <= 5%)")


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for opt in leaf_optimizers(optimizer) for s in opt.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def memory(ranks: list[int]) -> None:
    print("AdamW state (exp_avg + exp_avg_sq), all block matrices factorized vs full:")
    full_total = None
    for r in ["full", *ranks]:
        L.seed_everything(0)
        module = GPTLightningModule({}, lr=1e-3, schedule="constant")
        callbacks = []
        if r != "full":
            # head and output projections start at zero, so every block gradient is nonzero only from
            # step 2 on: split once at step 3, then take two steps so the factors' moments exist
            callbacks = [AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(steps=[3]),
                                           thresholds={"clobber_alignment": 0.0}, initial_rank=r, r_min=r, save_figure=False, log_per_matrix=False)]
        trainer = cpu_trainer(max_steps=5, callbacks=callbacks)
        trainer.fit(module, token_loader(n=5, sequence_len=module.config.sequence_len, vocab=256, batch_size=1))
        if callbacks:
            assert callbacks[0].matrices and all(m.state == "minor" for m in callbacks[0].matrices)
        label = "full" if r == "full" else f"r={r}"
        total = state_bytes(trainer.optimizers[0])
        full_total = full_total or total
        print(f"  {label:10s} {total / 2**20:8.2f} MiB   ratio vs full {total / full_total:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--direct-only", action="store_true",
                        help="only the CPU-time cost at the default batch (16) and at --batch-size")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps segments comparable
    for batch in dict.fromkeys((16, args.batch_size)):  # 16: configs/data/stdlib.yaml's batch
        amortized_overhead(batch, args.interval)
    if args.direct_only:
        return
    memory([64, 32, 8])
    time_overhead(args.rounds, args.interval, args.batch_size)


if __name__ == "__main__":
    main()
