"""AdaptiveSVDSwitch overhead on the default GPT (``GPTConfig()``), measured side by side in one run.

Time: one ``trainer.fit`` whose steps are cut into segments of ``--interval`` steps; segments
rotate between no callback, the switch with ``svd_method="full"`` and with ``"randomized"``, so each
switch segment holds exactly one SVD cycle plus ``interval − 1`` projected steps (every matrix is
forced into the "minor" state: the worst case for the per-step projection). Rotating keeps machine
noise common to all three; on a loaded machine the segment ratios still scatter by ±20%, so the
time spent inside the callback's hook, as a share of its segments, is printed as well. Memory: AdamW state bytes with every matrix factorized at rank r vs full.

    python benchmarks/adaptive_svd_overhead.py --rounds 2 --interval 100
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
    common = dict(minor_training="project", schedule=Schedule(steps=[0], every_n_steps=interval), clobber_alignment=0.0,
                  save_figure=False, log_per_matrix=False)
    switches = {"full": AdaptiveSVDSwitch(svd_method="full", **common),
                "randomized": AdaptiveSVDSwitch(svd_method="randomized", **common)}
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
            callbacks = [AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(steps=[3]), clobber_alignment=0.0,
                                           initial_rank=r, r_min=r, save_figure=False, log_per_matrix=False)]
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
    args = parser.parse_args()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread keeps segments comparable
    memory([64, 32, 8])
    time_overhead(args.rounds, args.interval, args.batch_size)


if __name__ == "__main__":
    main()
