"""Training-step time of the default GPT with each per-step method (CBP, L2-Init, weight clipping, Hare &
Tortoise) vs without.

Each round fits every configuration for ``--steps`` steps (after ``--warmup`` untimed ones) in turn,
so machine noise hits all alike; the step time of a configuration is the median over its steps and
rounds, and its overhead the ratio to the baseline's. Nothing is asserted.

    python benchmarks/per_step_methods_overhead.py [--rounds 3] [--steps 10] [--threads 1] [--device cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import ContinualBackprop, GPTConfig, GPTLightningModule, HareTortoise, L2Init, WeightClip

METHODS = {
    "baseline": lambda: [],
    "ContinualBackprop": lambda: [ContinualBackprop(replacement_rate=1e-4, maturity_threshold=100)],
    "L2Init": lambda: [L2Init(strength=1e-3)],
    "WeightClip": lambda: [WeightClip(kappa=2.0)],
    "HareTortoise": lambda: [HareTortoise(decay=0.999)],
}


class StepTimer(L.Callback):
    def __init__(self, warmup: int, clock):
        self.warmup, self.clock, self.times = warmup, clock, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        self._start = self.clock()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        if trainer.global_step > self.warmup:
            self.times.append(self.clock() - self._start)


def time_steps(method: str, args, clock) -> list[float]:
    L.seed_everything(0, verbose=False)
    config = GPTConfig()
    module = GPTLightningModule(config, {"schedule": "constant"})
    steps = args.warmup + args.steps
    tokens = torch.randint(0, 256, (args.batch_size * steps, config.sequence_len + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch_size)
    timer = StepTimer(args.warmup, clock)  # first: its batch-end hook runs after the method's
    trainer = L.Trainer(accelerator=args.device, devices=1, max_steps=steps, callbacks=[*METHODS[method](), timer],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, loader)
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per fit")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = leave as is)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times = {m: [] for m in METHODS}
    for _ in range(args.rounds):
        for method in METHODS:
            times[method] += time_steps(method, args, clock)
    base = statistics.median(times["baseline"])
    print(f"GPTConfig() batch {args.batch_size}, {args.device}, {args.rounds} rounds x {args.steps} steps, {args.clock} clock")
    for method, values in times.items():
        step = statistics.median(values)
        print(f"{method:>18}: {1000 * step:8.1f} ms/step  ratio {step / base:.3f}")


if __name__ == "__main__":
    main()
