"""Training throughput of our GPT against the same architecture written minimally, eager and
compiled, with compile times; and Lightning's training loop against a bare loop.

``MinimalGPT`` below is the default ``GPTConfig`` architecture in one screen of code, with no
registries, no KV cache and no callback slots: RoPE (split halves), QK-norm, relu² MLP, weightless
RMSNorm, untied head, logit soft-cap. It holds the same parameters under the same names, so the
script first copies our weights into it and checks that both give the same logits: the ratios
below compare implementations, not architectures.

All variants run in one process, interleaved round by round (one round = ``--steps`` steps of
each), and the tables print ratios of median step times: on a shared machine only ratios
measured side by side mean anything. Compile time is the first compiled step minus a median
compiled step, with Inductor's caches disabled (a warm cache would hide the cost).

    python benchmarks/throughput.py                       # GPTConfig(), batch 16x256, 2 threads
    python benchmarks/throughput.py --rounds 7 --steps 5 --batch 8 --threads 1 --clock cpu
    python benchmarks/throughput.py --device cuda --batch 32      # GPU: wall time between synchronizes

Targets: ours/minimal throughput >= 0.97 eager and >= 0.98 compiled; our compile time <= 1.5x
the minimal model's; Lightning loop overhead <= 5%.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.models import GPT, GPTConfig, GPTLightningModule


class MinimalBlock(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, d // n_head
        self.attn = nn.ModuleDict(dict(c_q=nn.Linear(d, d, bias=False), c_k=nn.Linear(d, d, bias=False),
                                       c_v=nn.Linear(d, d, bias=False), c_proj=nn.Linear(d, d, bias=False)))
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d, bias=False), c_proj=nn.Linear(4 * d, d, bias=False)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = F.rms_norm(x, (C,))
        q, k, v = (self.attn[n](h).view(B, T, self.n_head, self.head_dim).transpose(1, 2) for n in ("c_q", "c_k", "c_v"))
        q, k = F.rms_norm(rope(q, cos, sin), (self.head_dim,)), F.rms_norm(rope(k, cos, sin), (self.head_dim,))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        attn_out = self.attn["c_proj"](y.transpose(1, 2).reshape(B, T, C))
        x = x + attn_out
        h = F.relu(self.mlp["c_fc"](F.rms_norm(x, (C,))))
        return x + self.mlp["c_proj"](h * h)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


class MinimalGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.softcap = cfg.logit_softcap
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(MinimalBlock(cfg.n_embd, cfg.n_head) for _ in range(cfg.n_layer))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        hd = cfg.n_embd // cfg.n_head
        freqs = torch.outer(torch.arange(cfg.sequence_len).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("cos", freqs.cos(), persistent=False)  # (T, hd/2)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = F.rms_norm(self.wte(idx), (self.wte.embedding_dim,))
        for block in self.blocks:
            x = block(x, self.cos[:T], self.sin[:T])
        logits = self.lm_head(F.rms_norm(x, (x.shape[-1],))).float()
        return self.softcap * torch.tanh(logits / self.softcap)


def batches(n: int, batch: int, seq: int, vocab: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (n * batch, seq + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens.split(batch)]


CLOCK = time.perf_counter  # --clock cpu: time.process_time, this process's CPU time
DEVICE = torch.device("cpu")


def now() -> float:
    """The clock, after the GPU has finished what was queued (kernels run asynchronously)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return CLOCK()


class BareTrainer:
    """Forward, loss, backward, clip, AdamW step, zero_grad: what Lightning's loop does, without it."""

    def __init__(self, model: nn.Module, forward=None):
        self.model, self.forward = model, forward or model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        start = now()
        loss = F.cross_entropy(self.forward(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return now() - start


class _Timer(L.Callback):
    def __init__(self):
        self.times: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(now() - self._start)


def lightning_steps(module: GPTLightningModule, data) -> list[float]:
    timer = _Timer()
    trainer = L.Trainer(accelerator="gpu" if DEVICE.type == "cuda" else "cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        callbacks=[timer], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=DataLoader(TensorDataset(*map(torch.cat, zip(*data))), batch_size=len(data[0][0])))
    return timer.times[1:]  # the first step allocates the optimizer state


def nonzero_copy(ours: GPT, minimal: MinimalGPT) -> None:
    """Same random weights in both (non-zero head and projections, so backward does full work),
    and the same logits, checked."""
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.05)
        minimal.load_state_dict(ours.state_dict(), strict=True)
        x = torch.randint(0, 256, (2, ours.config.sequence_len), device=DEVICE)
        torch.testing.assert_close(ours(x), minimal(x), rtol=1e-4, atol=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu | cuda (GPU timings are wall time between synchronizes)")
    parser.add_argument("--no-lightning", action="store_true", help="skip the Lightning-vs-bare comparison")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="this process's CPU time, robust on shared cores (use --threads 1); Inductor then "
                             "compiles in this process, so compile times are CPU time too")
    args = parser.parse_args()
    global CLOCK, DEVICE
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and args.clock == "cpu":
        parser.error("--clock cpu measures this process's CPU time, not the GPU's work: use --clock wall with cuda")
    if args.clock == "cpu":
        torch._inductor.config.compile_threads = 1
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch._inductor.config.force_disable_caches = True  # measure compilation, not a cache lookup
    torch.manual_seed(0)
    cfg = GPTConfig()
    data = [(x.to(DEVICE), y.to(DEVICE)) for x, y in batches(args.steps, args.batch, cfg.sequence_len)]

    ours, minimal = GPT(cfg).to(DEVICE), MinimalGPT(cfg).to(DEVICE)
    nonzero_copy(ours, minimal)
    ours_c, minimal_c = GPT(cfg).to(DEVICE), MinimalGPT(cfg).to(DEVICE)
    nonzero_copy(ours_c, minimal_c)
    trainers = {"ours eager": BareTrainer(ours), "minimal eager": BareTrainer(minimal),
                "ours compiled": BareTrainer(ours_c, torch.compile(ours_c.forward, dynamic=False)),
                "minimal compiled": BareTrainer(minimal_c, torch.compile(minimal_c.forward, dynamic=False))}
    torch.compile(lambda t: (t * 2).sum())(torch.ones(3, device=DEVICE))  # pay Inductor's one-time start-up outside the timings
    first = {name: t.step(*data[0]) for name, t in trainers.items()}  # compiles the two compiled variants
    times: dict[str, list[float]] = {name: [] for name in trainers}
    light, bare = [], []
    if not args.no_lightning:
        module = GPTLightningModule(cfg, {"lr": 1e-4, "schedule": "constant"})
        bare_model = GPT(cfg).to(DEVICE)
        bare_model.load_state_dict(module.model.state_dict())
        bare_trainer = BareTrainer(bare_model, lambda x: bare_model(x))
    for r in range(args.rounds):  # interleaved: drifts in machine load hit every variant alike
        order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
        for name in order:
            times[name] += [trainers[name].step(x, y) for x, y in data]
        if not args.no_lightning:
            light += lightning_steps(module, data)
            bare += [bare_trainer.step(x, y) for x, y in data[1:]]

    med = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.batch * cfg.sequence_len
    where = (f"{torch.cuda.get_device_name(DEVICE)}, torch {torch.__version__}, float32" if DEVICE.type == "cuda"
             else f"{torch.get_num_threads()} threads")
    print(f"GPTConfig() {cfg.n_layer}x{cfg.n_embd} {cfg.mlp}/{cfg.position}, {sum(p.numel() for p in ours.parameters()):,} "
          f"params, batch {args.batch}x{cfg.sequence_len}, {args.rounds} rounds x {args.steps} steps, {where}, "
          f"{args.clock} clock (logits of ours and minimal checked equal)")
    print(f"{'variant':<18}{'ms/step':>9}{'tok/s':>10}{'compile s':>11}")
    for name in trainers:
        compile_s = f"{first[name] - med[name]:.1f}" if "compiled" in name else "-"
        print(f"{name:<18}{1e3 * med[name]:>9.1f}{tokens / med[name]:>10,.0f}{compile_s:>11}")
    compile_ratio = (first["ours compiled"] - med["ours compiled"]) / (first["minimal compiled"] - med["minimal compiled"])
    print(f"ours/minimal throughput, eager:    {med['minimal eager'] / med['ours eager']:.3f}  (target >= 0.97)")
    print(f"ours/minimal throughput, compiled: {med['minimal compiled'] / med['ours compiled']:.3f}  (target >= 0.98)")
    print(f"ours/minimal compile time:         {compile_ratio:.2f}  (target <= 1.5)")
    print(f"compiled/eager speed-up, ours:     {med['ours eager'] / med['ours compiled']:.2f}x")
    ratios = [m / o for m, o in zip(times["minimal eager"], times["ours eager"])]
    print(f"per-step ratio quartiles (eager):  {', '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4))}")
    if not args.no_lightning:
        overhead = statistics.median(light) / statistics.median(bare) - 1
        print(f"Lightning loop vs bare loop (ours eager, clip + AdamW): {1e3 * statistics.median(light):.1f} vs "
              f"{1e3 * statistics.median(bare):.1f} ms/step, overhead {100 * overhead:+.1f}%  (target <= 5%)")


if __name__ == "__main__":
    main()
