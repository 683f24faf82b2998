"""Training throughput: our GPT vs a plain nanoGPT-style GPT, and Lightning's loop vs a bare loop.

Both comparisons run side by side in one process, alternating rounds, and print ratios of the
median per-step times (these machines are noisy; only ratios measured together mean anything).

    python benchmarks/throughput.py            # default GPT size, CPU
    python benchmarks/throughput.py --rounds 5 --steps 20
"""
from __future__ import annotations

import argparse
import math
import statistics
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.models import GPT, GPTConfig, GPTLightningModule


class PlainGPT(nn.Module):
    """The simplest nanoGPT-manner GPT: learned positions, LayerNorm, fused qkv, GELU MLP."""

    def __init__(self, vocab: int, seq: int, d: int, n_layer: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d, bias=False), proj=nn.Linear(d, d, bias=False),
                               ln2=nn.LayerNorm(d), fc=nn.Linear(d, 4 * d, bias=False), out=nn.Linear(4 * d, d, bias=False)))
            for _ in range(n_layer))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + b["proj"](y)
            x = x + b["out"](F.gelu(b["fc"](b["ln2"](x))))
        return self.head(self.ln_f(x))


def data(n_batches: int, batch: int, seq: int, vocab: int = 256):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n_batches * batch, seq + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def bare_steps(model: nn.Module, loader, opt, sched=None) -> float:
    """Seconds per step of a plain loop: forward, loss, backward, clip, step, zero_grad."""
    start = time.perf_counter()
    for x, y in loader:
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return (time.perf_counter() - start) / len(loader)


class _Timer(L.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        self.elapsed = time.perf_counter() - self.start


def lightning_steps(module: GPTLightningModule, loader) -> float:
    timer = _Timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[timer], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)
    return timer.elapsed / len(loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig()
    loader = data(args.steps, args.batch, cfg.sequence_len)

    ours = GPT(cfg)
    plain = PlainGPT(cfg.vocab_size, cfg.sequence_len, cfg.n_embd, cfg.n_layer, cfg.n_head)
    for m in (ours, plain):  # a non-zero head so both do the same backward work
        nn.init.normal_(m.head.weight if hasattr(m, "head") else m.lm_head.weight, std=0.02)
    n_ours, n_plain = (sum(p.numel() for p in m.parameters()) for m in (ours, plain))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)

    module = GPTLightningModule(cfg, optimizer="adamw", lr=1e-4, schedule="cosine")
    bare_model = GPTLightningModule(cfg, optimizer="adamw", lr=1e-4, schedule="cosine").model
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-4)
    bare_sched = torch.optim.lr_scheduler.LambdaLR(bare_opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / 1e4)))

    bare_steps(ours, loader, opt_ours), bare_steps(plain, loader, opt_plain)  # warm-up
    t_ours, t_plain, t_light, t_bare = [], [], [], []
    for r in range(args.rounds):  # alternate, so drifts in machine load hit both sides alike
        t_ours.append(bare_steps(ours, loader, opt_ours))
        t_plain.append(bare_steps(plain, loader, opt_plain))
        t_light.append(lightning_steps(module, loader))
        t_bare.append(bare_steps(bare_model, loader, bare_opt, bare_sched))
    med = statistics.median
    tokens = args.batch * cfg.sequence_len
    print(f"GPTConfig defaults: {n_ours:,} params (ours) vs {n_plain:,} (plain nanoGPT-style); "
          f"batch {args.batch}x{cfg.sequence_len}, {args.rounds} rounds x {args.steps} steps, {args.threads} threads")
    print(f"  our GPT, bare loop        {tokens / med(t_ours):10,.0f} tok/s")
    print(f"  plain GPT, bare loop      {tokens / med(t_plain):10,.0f} tok/s")
    print(f"  ratio ours/plain throughput: {med(t_plain) / med(t_ours):.3f}  (target >= 0.95)")
    print(f"  our GPT, Lightning loop   {tokens / med(t_light):10,.0f} tok/s")
    print(f"  our GPT, bare loop+sched  {tokens / med(t_bare):10,.0f} tok/s")
    print(f"  Lightning loop overhead: {100 * (med(t_light) / med(t_bare) - 1):+.1f}%  (target <= 5%)")


if __name__ == "__main__":
    main()
