"""Training-step time with PlasticityMonitor at its default intervals vs without it, on the package GPT and a
Hugging Face Llama.

One fit per model. Steps cycle through modes, so machine noise hits all of them alike:

- ``baseline``: the monitor's forward hooks detached and nothing due (as if it were not attached);
- ``idle``: hooks attached, nothing due (most steps at the default intervals);
- ``activations`` / ``weights`` / ``spectra``: that group alone measures in this step.

The cost at the default intervals (``activations`` and ``weights`` every 100 steps, ``spectra`` every 500) is
``idle + Σ_group (group − idle) / interval``, each a median over cycles, relative to the median baseline step.
``--clock cpu`` times this process's CPU time (``--threads 1``). On a shared CPU those medians scatter by more
than the 1 % being measured, so the script also times the monitor's own work directly, on the activations and
weights of the run (the minimum over repetitions: what the work costs when nothing else runs), against the
fastest baseline step: ``(idle + Σ_group work / interval) / step``.

    python benchmarks/monitor_overhead.py [--cycles 8] [--models gpt llama] [--clock cpu --threads 1]
    python benchmarks/monitor_overhead.py --figure docs/monitor.png   # the figure of docs/monitor.md

Goal: <= 1 % of the training time at the defaults on both models.
"""
from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks import GPTConfig, GPTLightningModule, PlasticityMonitor

DEFAULTS = {"activations": 100, "weights": 100, "spectra": 500}
MODES = ("baseline", "idle", *DEFAULTS)
WARMUP = len(MODES)  # one cycle, not timed: optimizer state, allocator warm-up


class LlamaModule(L.LightningModule):
    """A Llama-family causal LM from a small config (random init, nothing downloaded), AdamW."""

    def __init__(self, vocab: int):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class CycleDriver(L.Callback):
    """Sets which group the monitor measures in each step (its ``every``) and times steps. A baseline step has
    the monitor's forward hooks removed by its own ``on_fit_end``; the next step puts them back by its
    ``on_fit_start``."""

    def __init__(self, monitor: PlasticityMonitor, clock):
        self.monitor, self.clock = monitor, clock
        self.times: dict[str, list[float]] = {m: [] for m in MODES}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        mode = MODES[trainer.global_step % len(MODES)]
        self.monitor.every = {g: (1 if g == mode else None) for g in (*DEFAULTS, "curvature")}
        if mode == "baseline":
            self.monitor.on_fit_end(trainer, pl_module)
        elif mode == "idle":
            self.monitor.on_fit_start(trainer, pl_module)
        _sync(pl_module)
        self._mode, self._start = mode, self.clock()

    def stop(self, trainer, pl_module) -> None:
        _sync(pl_module)
        if trainer.global_step > WARMUP:
            self.times[self._mode].append(self.clock() - self._start)


class StopClock(L.Callback):
    """Listed after the monitor: its measuring work at the batch end is inside the timed step."""

    def __init__(self, driver: CycleDriver):
        self.driver = driver

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.driver.stop(trainer, pl_module)


def _sync(module) -> None:
    if module.device.type == "cuda":
        torch.cuda.synchronize()


def build(name: str, batch: int, sequence: int, steps: int):
    if name == "gpt":
        config = GPTConfig()
        module = GPTLightningModule(config, {"schedule": "constant"})
        vocab, sequence = 256, config.sequence_len
        label = f"GPT {config.n_layer}x{config.n_embd} {config.mlp}"
    else:
        vocab = 1024
        module, label = LlamaModule(vocab), "HF Llama 4x256 SwiGLU (intermediate 688)"
    tokens = torch.randint(0, vocab, (batch * steps, sequence + 1))
    return module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch), \
        f"{label}, batch {batch}x{sequence}"


def measure(name: str, args) -> None:
    L.seed_everything(0, verbose=False)
    steps = WARMUP + len(MODES) * args.cycles
    module, loader, label = build(name, args.batch_size, args.sequence, steps)
    monitor = PlasticityMonitor(plot=False)
    driver = CycleDriver(monitor, time.process_time if args.clock == "cpu" else time.perf_counter)
    trainer = L.Trainer(accelerator=args.device, devices=1, max_steps=steps, logger=False,
                        callbacks=[driver, monitor, StopClock(driver)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, loader)
    cycles = min(len(t) for t in driver.times.values())
    median = {m: statistics.median(t[:cycles]) for m, t in driver.times.items()}
    # per cycle, each mode against the baseline step of its own cycle: slow drifts of the machine cancel
    ratio = {m: statistics.median(t / b for t, b in zip(driver.times[m], driver.times["baseline"])) - 1
             for m in MODES}
    default = ratio["idle"] + sum((ratio[g] - ratio["idle"]) / every for g, every in DEFAULTS.items())
    print(f"\n{label}, {args.device}, {torch.get_num_threads()} threads, {cycles} cycles, {args.clock} clock; "
          f"{len(monitor.layers)} neuron layers, {len(monitor.names)} parameters "
          f"({sum(p.numel() for p in module.parameters()) / 1e6:.1f} M)")
    print(f"{'mode':<14}{'median step ms':>16}{'median of per-cycle ratio - 1':>32}")
    for m in MODES:
        print(f"{m:<14}{median[m] * 1e3:>16.1f}{100 * ratio[m]:>+31.2f}%")
    print(f"side by side, at the default intervals {DEFAULTS}: monitor/no monitor = {1 + default:.4f} "
          f"({100 * default:+.2f} %, goal <= 1 %)")
    step = min(driver.times["baseline"])
    work = direct_costs(monitor, trainer, module, next(iter(loader)), driver.clock)
    direct = (work["idle"] + sum(work[g] / every for g, every in DEFAULTS.items())) / step
    print("direct, the monitor's own work: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in work.items())
          + f"; fastest baseline step {step * 1e3:.1f} ms")
    print(f"direct, at the default intervals: monitor/no monitor = {1 + direct:.4f} "
          f"({100 * direct:+.3f} %, goal <= 1 %)")


def direct_costs(monitor, trainer, module, batch, clock, reps: int = 7) -> dict[str, float]:
    """Seconds of the monitor's own work per step, through its Lightning hooks, each the minimum over ``reps``.

    ``weights`` / ``spectra``: its three step hooks (``on_train_batch_start``, ``on_before_optimizer_step``,
    ``on_train_batch_end``) with that group due. ``activations``: the hooks around a training-mode forward of the
    run's batch (its forward hooks collect), less the same forward without the monitor. ``idle``: the hooks with
    nothing due, plus its forward hooks when nothing is due: a forward of one token with them less one without,
    which resolves microseconds (their cost when idle does not depend on the batch). The step hooks see a
    stand-in trainer whose global step advances by one per step, as a fit's does."""
    from types import SimpleNamespace

    module.train()
    x = batch[0].to(module.device)
    one_token = x[:1, :1]
    step = SimpleNamespace(global_step=trainer.global_step, world_size=1, strategy=trainer.strategy, loggers=[],
                           callback_metrics={})

    def forward(tokens):
        with torch.no_grad():
            module.model(tokens) if isinstance(module, GPTLightningModule) else module.model(input_ids=tokens)

    def hooks(group, between=None):
        monitor.every = {g: (1 if g == group else None) for g in (*DEFAULTS, "curvature")}
        step.global_step += 1  # a new optimizer step: the monitor decides what is due
        monitor.on_train_batch_start(step, module, batch, 0)
        if between is not None:
            between()
        monitor.on_before_optimizer_step(step, module, None)
        step.global_step += 1  # the optimizer stepped
        monitor.on_train_batch_end(step, module, None, batch, 0)

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            _sync(module)
            start = clock()
            fn()
            _sync(module)
            times.append(clock() - start)
        return min(times)

    monitor.on_fit_end(trainer, module)  # forward hooks off
    bare = {"batch": timed(lambda: forward(x)), "token": timed(lambda: forward(one_token))}
    monitor.on_fit_start(trainer, module)  # forward hooks on, as in a fit
    costs = {
        "idle": timed(lambda: hooks(None)) + max(0.0, timed(lambda: forward(one_token)) - bare["token"]),
        "activations": max(0.0, timed(lambda: hooks("activations", lambda: forward(x))) - bare["batch"]),
        "weights": timed(lambda: hooks("weights")),
        "spectra": timed(lambda: hooks("spectra")),
    }
    monitor.on_fit_end(trainer, module)
    return costs


def draw_figure(path: str) -> None:
    """The monitor's figure for a 128-128 MLP trained warm on 8 tasks of the random-label digits stream."""
    import shutil
    import tempfile

    from plasticity_callbacks.data.digits import RandomLabelDigits
    from plasticity_callbacks.models.classifier import DigitsClassifier

    L.seed_everything(0, verbose=False)
    monitor = PlasticityMonitor(activations_every_n_steps=25, weights_every_n_steps=25, spectra_every_n_steps=50,
                                feature_layers=["*"])
    with tempfile.TemporaryDirectory() as folder:
        trainer = L.Trainer(max_steps=8 * 150, callbacks=[monitor], logger=False, default_root_dir=folder,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(DigitsClassifier(widths=[128, 128], lr=1e-2),
                    datamodule=RandomLabelDigits(num_tasks=8, steps_per_task=150, batch_size=64))
        shutil.copy(f"{folder}/figures/plasticity_monitor.png", path)
    first, last = monitor.history[0], monitor.history[-1]
    for key in ("monitor/dead", "monitor/feature_erank", "monitor/grad_norm"):
        print(f"{key}: {first[key]:.3f} at step {first['step']} -> {last[key]:.3f} at step {last['step']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--cycles", type=int, default=8, help="timed cycles of the modes")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = leave as is)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--sequence", type=int, default=256, help="Llama's sequence length (the GPT uses its own)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--figure", help="draw the digits-stream figure of docs/monitor.md to this PNG instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.figure:
        return draw_figure(args.figure)
    for name in args.models:
        measure(name, args)


if __name__ == "__main__":
    main()
