"""A nanoGPT-shaped training loop with FIRE, ReDo, DASH and Shrink & Perturb, no Lightning.

The task switches halfway (the next token is the current one plus another offset); the four methods are
five lines of the loop, marked ``# plasticity``, all from :mod:`plasticity_callbacks.ops`.

    python examples/plain_loop.py --steps 200
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from plasticity_callbacks.models import GPT, GPTConfig
from plasticity_callbacks.ops import ActivationStats, dash_, fire_, redo_, shrink_perturb_


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
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, sequence_len=32, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    switch_at = args.steps // 2
    with ActivationStats(model) as stats:  # plasticity: ReDo's statistics, collected in the forwards below
        for step in range(args.steps):
            x, y = get_batch(step, switch_at, config)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B·T, vocab) against (B·T,)
            loss.backward()
            if step % 50 == 49:
                dash_(model, optimizer, min_factor=0.3)  # plasticity: DASH, with this step's gradient
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 49:
                recycled = redo_(model, optimizer, stats, tau=0.1, seed=step)  # plasticity: ReDo
                print(f"step {step}: loss {loss.item():.3f}, ReDo recycled {int(sum(recycled.values()))} neurons")
            if step == switch_at:  # the task switch: FIRE, then a small Shrink & Perturb
                fire_(model, optimizer)  # plasticity: FIRE
                shrink_perturb_(model, optimizer, shrink=0.9, perturb=0.05, seed=step)  # plasticity: S&P
    print(f"final loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
