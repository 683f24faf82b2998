"""A Lightning Fabric loop (litgpt's trainer shape) with FIRE, ReDo, DASH and Shrink & Perturb.

The callbacks are the ones a ``lightning.Trainer`` takes; :class:`FabricPlasticity` calls their hooks from
the loop (four lines, marked ``# plasticity``) and writes their metrics to Fabric's loggers.

    python examples/fabric_loop.py --steps 200
"""
from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.fabric.loggers import CSVLogger

from plasticity_callbacks import DASHPeriodic, FIREReinit, ReDoMonitor, Schedule, ShrinkPerturb
from plasticity_callbacks.integrations.fabric import FabricPlasticity
from plasticity_callbacks.models import GPT, GPTConfig


def get_batch(step: int, switch_at: int, config: GPTConfig, batch_size: int = 16):
    """Token sequences whose next token is the current one plus an offset that changes at the task switch."""
    offset = 1 if step < switch_at else 7
    start = torch.randint(0, config.vocab_size, (batch_size, 1))
    seq = (start + offset * torch.arange(config.sequence_len + 1)) % config.vocab_size  # (B, T+1)
    return seq[:, :-1], seq[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=CSVLogger("fabric_logs"))
    fabric.seed_everything(0)
    config = GPTConfig(vocab_size=64, sequence_len=32, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(config)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    switch_at = args.steps // 2
    every = max(2, args.steps // 4)
    callbacks = [FIREReinit(schedule=Schedule(steps=[switch_at])),
                 ReDoMonitor(tau=0.1, schedule=Schedule(every_n_steps=every)),
                 DASHPeriodic(schedule=Schedule(every_n_steps=every)),
                 ShrinkPerturb(shrink=0.9, perturb=0.05, schedule=Schedule(steps=[switch_at]))]
    with FabricPlasticity(fabric, model, optimizer, *callbacks) as plasticity:  # plasticity
        for step in range(args.steps):
            plasticity.batch_start(step)  # plasticity
            x, y = get_batch(step, switch_at, config)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B·T, vocab) against (B·T,)
            fabric.backward(loss)
            plasticity.before_optimizer_step()  # plasticity
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            plasticity.batch_end(step)  # plasticity
            fabric.log("train/loss", loss.item(), step=step)
    fabric.logger.finalize("success")
    fired = [h["global_step"] for h in callbacks[0].history]
    fabric.print(f"final loss {loss.item():.3f}; FIRE acted at steps {fired}")


if __name__ == "__main__":
    main()
