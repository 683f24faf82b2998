"""AdaptiveSVDSwitch overhead: the callback driven by Lightning's own hooks in a real ``trainer.fit``.

    python benchmarks/adaptive_svd_overhead.py                          # widths 128,256,512; batches 1, 16
    python benchmarks/adaptive_svd_overhead.py --widths 128 --batches 1 --memory
    python benchmarks/adaptive_svd_overhead.py --compare full --default-thresholds  # decisions vs LAPACK SVD
    python benchmarks/adaptive_svd_overhead.py --minor-training project,factorize  # other routes, one baseline

Per GPT width (4 layers, sequence 256, byte vocabulary) and batch size: a switch-free baseline fit, then one
fit per route (``--minor-training``, default ``project,project-after``), then the baseline again, all in this
process. Each fit with the switch runs SVD cycles every ``--every`` steps (so a short fit holds several), every
matrix forced into the "minor" state (``clobber_alignment=0``: the worst case, every step a minor one). A
subclass of the switch times its own hooks in process CPU time (robust on a shared machine), a clock callback
times each whole step. Two rows per route:

* ``hooks``: from the hooks' medians (one SVD cycle, the per-step hook time) over the step's,
  ``(cycle + (interval − 1)·hooks) / (interval · step)`` at the default interval (``--interval``, 100);
* ``steps``: from whole steps against the baseline's, ``(cycle step − base + (interval − 1)·(minor step −
  base)) / (interval · base)``: what the route costs or saves in the step itself is counted too.

Routes: ``project`` (the default: a minor Linear's projected gradient computed in the backward, its full
gradient never formed, see ``ops.minor_gradient``), ``project-after`` (``skip_full_gradient=False``: the full
gradient projected after the backward), ``factorize``. The last line compares each route's decisions and end
weights with the first's. Targets: ≤ 1 % at every width, ≤ 5 % at 1×256.

``--memory``: AdamW state bytes with every block matrix factorized at rank r against full.

``--warm-vs-full``: per width, one fit (batch 1) whose every cycle first computes each matrix's decision with
the full SVD on the same weights and gradients (timed, then discarded), then runs the real cycle, warm-started
from the second cycle on (``SVDOptions.warm``); and a few steps of a switch-free 16×256 fit. One table: the cycle
with either, as a share of a 1×256 and a 16×256 step at ``--interval`` (per-step projection hooks included),
whether both gave the same decisions, and how many warm starts fell back to the full SVD.
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
from plasticity_callbacks.ops.optimizer_state import leaf_optimizers  # noqa: E402
from plasticity_callbacks.callbacks.schedule import Schedule  # noqa: E402
from plasticity_callbacks.functional.subspace import as_matrix  # noqa: E402


class TimedSwitch(AdaptiveSVDSwitch):
    """The real switch; each hook's process CPU time is added to the current step's record."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        started = time.process_time()
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.hook_seconds += time.process_time() - started

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.cycled = self._cycle_now  # the schedule said so in on_train_batch_start
        started = time.process_time()
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        self.hook_seconds += time.process_time() - started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        started = time.process_time()
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.hook_seconds += time.process_time() - started


class StepClock(L.Callback):
    """Process CPU time from one step's first hook to the next's, and the switch's share of it; first in
    the callback list, so every hook of the switch falls inside the step it belongs to."""

    def __init__(self, switch: TimedSwitch | None = None):
        self.switch = switch
        self.steps: list[tuple[int, float, float, bool]] = []  # (step, step seconds, hook seconds, cycled)
        self._open: tuple[int, float] | None = None

    def _close(self) -> None:
        if self._open is not None:
            step, started = self._open
            hooks, cycled = (self.switch.hook_seconds, self.switch.cycled) if self.switch else (0.0, False)
            self.steps.append((step, time.process_time() - started, hooks, cycled))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        if self.switch is not None:
            self.switch.hook_seconds, self.switch.cycled = 0.0, False
        self._open = (trainer.global_step, time.process_time())

    def on_train_end(self, trainer, pl_module):
        self._close()
        self._open = None


class DualSwitch(TimedSwitch):
    """At each cycle, every matrix's decision by the full SVD (``svd.warm`` off) on the same weights and gradients,
    timed and kept aside, then the real cycle (warm from the second on), its decisions timed alike."""

    def on_fit_start(self, trainer, pl_module):
        super().on_fit_start(trainer, pl_module)
        self.records = []  # per cycle: (full decide s, warm decide s, real cycle s, same decisions)
        self.shapes = []  # per cycle: {"square" | "wide" | "tall": (full decide s, warm decide s, matrices)}

    def _cycle(self, trainer, pl_module):
        step, full, self.by_shape = trainer.global_step, [], {}
        started = time.process_time()
        for m in self.matrices:
            grad = m.target.param.grad
            grad = m.target.oriented(grad) if grad is not None else None
            W = as_matrix(m.target.read())
            begun = time.process_time()
            _, state, r_next, _ = self._decide(m, W, grad, m.U_prev, step, warm=False)
            seconds = self.by_shape.setdefault(shape_of(W), [0.0, 0.0, 0])
            seconds[0] += time.process_time() - begun
            seconds[2] += 1
            full.append((state, r_next))
        full_seconds = time.process_time() - started
        self.decide_seconds = 0.0
        started = time.process_time()
        metrics = super()._cycle(trainer, pl_module)
        cycle_seconds = time.process_time() - started
        warm = [(state, r) for _, _, state, r in self.history[-len(self.matrices):]]
        self.records.append((full_seconds, self.decide_seconds, cycle_seconds, full == warm))
        self.shapes.append(self.by_shape)
        return metrics

    def _decide(self, m, W, *args, **kwargs):
        started = time.process_time()
        out = super()._decide(m, W, *args, **kwargs)
        if kwargs.get("warm"):
            seconds = time.process_time() - started
            self.decide_seconds += seconds
            self.by_shape[shape_of(W)][1] += seconds
        return out


def shape_of(W: torch.Tensor) -> str:
    return "square" if W.shape[0] == W.shape[1] else "wide" if W.shape[0] < W.shape[1] else "tall"


def warm_vs_full(widths: list[int], interval: int, every: int, cycles: int, layers: int = 4,
                 sequence_len: int = 256) -> None:
    """The table of ``--warm-vs-full`` (see the module docstring)."""
    print(f"Cycle cost, full SVD vs warm start, every matrix minor (worst case); share of one step at interval "
          f"{interval}, projection hooks included; medians over cycles 2..{cycles + 1} (cycle 1 has no previous U)")
    print(f"{'width':>5} {'step 1x256':>10} {'step 16x256':>11} {'full cycle':>10} {'warm cycle':>10} "
          f"{'full %1x':>8} {'warm %1x':>8} {'full %16x':>9} {'warm %16x':>9} {'same':>5} {'fallbacks':>9}")
    for width in widths:
        L.seed_everything(0)
        module = gpt_module(width, layers, sequence_len)
        switch = DualSwitch(minor_training="project", schedule=Schedule(every_n_steps=every, start_step=every),
                            thresholds={"clobber_alignment": 0.0}, save_figure=False, log_per_matrix=False)
        clock = StepClock(switch)
        steps = every * (cycles + 1) + 1
        loader = token_loader(n=steps, sequence_len=sequence_len, vocab=256, batch_size=1)
        cpu_trainer(max_steps=steps, callbacks=[clock, switch]).fit(module, loader)
        step1 = statistics.median(t - h for _, t, h, c in clock.steps[1:] if not c)
        hooks = median_or_nan([h for s, _, h, c in clock.steps if s > every and not c])
        step16 = baseline_step(width, 16, every=1, cycles=2, layers=layers, sequence_len=sequence_len)
        later = switch.records[1:]
        full = statistics.median(f + c - w for f, w, c, _ in later)  # the real cycle with the full SVD's decisions
        warm = statistics.median(c for *_, c, _ in later)
        same = all(same for *_, same in later)

        def share(cycle, step):
            return 100 * (cycle + (interval - 1) * hooks) / (interval * step)

        print(f"{width:5d} {step1:9.3f}s {step16:10.3f}s {full:9.3f}s {warm:9.3f}s {share(full, step1):7.2f}% "
              f"{share(warm, step1):7.2f}% {share(full, step16):8.3f}% {share(warm, step16):8.3f}% "
              f"{'yes' if same else 'NO':>5} {switch.warm_fallbacks:4d}/{switch.warm_cycles:<4d}", flush=True)
        parts = []
        for shape in ("square", "wide", "tall"):
            cycles_of = [s[shape] for s in switch.shapes[1:] if shape in s]
            if cycles_of:
                full_s, warm_s = (statistics.median(c[i] for c in cycles_of) for i in (0, 1))
                parts.append(f"{cycles_of[0][2]} {shape} {full_s:.3f}s / {warm_s:.3f}s")
        print(f"      decisions per cycle by shape, full / warm (CPU s, medians): {'; '.join(parts)}", flush=True)


def gpt_module(width: int, layers: int, sequence_len: int) -> GPTLightningModule:
    config = dict(n_embd=width, n_head=max(1, width // 64), n_kv_head=max(1, width // 64), n_layer=layers,
                  sequence_len=sequence_len)
    return GPTLightningModule(config, {"lr": 1e-3, "schedule": "constant"})


def measure(width: int = 128, batch_size: int = 1, interval: int = 100, every: int = 4, cycles: int = 3,
            layers: int = 4, sequence_len: int = 256, worst_case: bool = True, minor_training: str = "project",
            **switch_options) -> dict:
    """Fit with the switch acting every ``every`` steps; return the medians and the share at ``interval``.

    ``worst_case``: every matrix forced "minor" (``clobber_alignment=0``); else the default thresholds.
    Returns a dict with ``cycles`` (SVD cycles that ran), ``matrices``, ``minor`` (matrices in the "minor"
    state at the end), ``step``, ``cycle``, ``projection`` (seconds), ``share`` (the switch's time over the
    steps' at ``interval``), ``cycle_step`` and ``minor_step`` (whole steps: a cycle's, and the median
    step after the first cycle that ran none), ``history`` (the switch's ``(step, matrix, state, r)``
    decisions) and ``weights`` (each target's effective weight at the end)."""
    L.seed_everything(0)
    module = gpt_module(width, layers, sequence_len)
    thresholds = {"clobber_alignment": 0.0} if worst_case else {}
    options = dict(schedule=Schedule(every_n_steps=every, start_step=every), thresholds=thresholds,
                   save_figure=False, log_per_matrix=False, **switch_options)
    if minor_training == "project-after":  # every minor gradient formed whole, then projected
        switch = TimedSwitch(minor_training="project", skip_full_gradient=False, **options)
    else:
        switch = TimedSwitch(minor_training=minor_training, **options)
    clock = StepClock(switch)
    steps = every * (cycles + 1) + 1
    loader = token_loader(n=steps * batch_size, sequence_len=sequence_len, vocab=256, batch_size=batch_size)
    cpu_trainer(max_steps=steps, callbacks=[clock, switch]).fit(module, loader)
    ran = [s for s in clock.steps if s[3]]
    later = [s for s in clock.steps if s[0] > every and not s[3]]  # after the first cycle: every matrix minor
    cycle = median_or_nan([h for *_, h, _ in ran])
    projection = median_or_nan([h for *_, h, _ in later])
    step = statistics.median(t - h for _, t, h, _ in clock.steps[1:])
    return {"cycles": len(ran), "matrices": len(switch.matrices), "step": step, "cycle": cycle,
            "minor": sum(m.state == "minor" for m in switch.matrices), "projection": projection,
            "share": (cycle + (interval - 1) * projection) / (interval * step), "history": list(switch.history),
            "cycle_step": median_or_nan([t for _, t, *_ in ran]),
            "minor_step": median_or_nan([t for _, t, *_ in later]),
            "weights": [m.target.read().detach().clone() for m in switch.matrices]}


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def baseline_step(width: int = 128, batch_size: int = 1, every: int = 4, cycles: int = 3, layers: int = 4,
                  sequence_len: int = 256) -> float:
    """Median step (process CPU seconds) of the same fit as ``measure`` without the switch."""
    L.seed_everything(0)
    module = gpt_module(width, layers, sequence_len)
    clock = StepClock()
    steps = every * (cycles + 1) + 1
    loader = token_loader(n=steps * batch_size, sequence_len=sequence_len, vocab=256, batch_size=batch_size)
    cpu_trainer(max_steps=steps, callbacks=[clock]).fit(module, loader)
    return statistics.median(t for _, t, *_ in clock.steps[1:])


def decisions_differ(a: list, b: list) -> str:
    """How two runs' ``(step, matrix, state, r)`` decisions compare, cycle by cycle."""
    if a == b:
        return "same decisions"
    steps = sorted({h[0] for h in a} | {h[0] for h in b})
    differ = [s for s in steps if [h for h in a if h[0] == s] != [h for h in b if h[0] == s]]
    states = sum(x[2] != y[2] for x, y in zip(a, b))
    return (f"decisions differ at cycle steps {differ} of {steps} ({states} of {len(a)} states differ, "
            f"the rest in r)")


def state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for opt in leaf_optimizers(optimizer) for s in opt.state.values()
               for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def memory(ranks: list[int]) -> None:
    print("AdamW state (exp_avg + exp_avg_sq), all block matrices factorized vs full:")
    full_total = None
    for r in ["full", *ranks]:
        L.seed_everything(0)
        module = GPTLightningModule({}, {"lr": 1e-3, "schedule": "constant"})
        callbacks = []
        if r != "full":  # split once at step 3 (the zero-initialized projections have gradients by then)
            callbacks = [AdaptiveSVDSwitch(minor_training="factorize", schedule=Schedule(steps=[3]),
                                           thresholds={"clobber_alignment": 0.0}, initial_rank=r, r_min=r,
                                           save_figure=False, log_per_matrix=False)]
        trainer = cpu_trainer(max_steps=5, callbacks=callbacks)
        trainer.fit(module, token_loader(n=5, sequence_len=module.config.sequence_len, vocab=256, batch_size=1))
        total = state_bytes(trainer.optimizers[0])
        full_total = full_total or total
        label = "full" if r == "full" else f"r={r}"
        print(f"  {label:10s} {total / 2**20:8.2f} MiB   ratio vs full {total / full_total:6.3f}")


def report(label: str, r: dict, target: float) -> None:
    print(f"  {label}: {r['matrices']} matrices, {r['cycles']} cycles; step {1e3 * r['step']:7.1f} ms, SVD cycle "
          f"{1e3 * r['cycle']:7.1f} ms, projection {1e3 * r['projection']:5.2f} ms/step -> {100 * r['share']:5.2f} % "
          f"(target <= {target:g} %)", flush=True)


def report_route(label: str, r: dict, base: float, interval: int, target: float) -> None:
    """A route against the step without the switch: the cycle step's and a minor step's excess over it."""
    cycle, minor = r["cycle_step"] - base, r["minor_step"] - base
    share = (cycle + (interval - 1) * minor) / (interval * base)
    print(f"  {label}: cycle step {1e3 * r['cycle_step']:7.1f} ms (+{1e3 * cycle:6.1f}), minor step "
          f"{1e3 * r['minor_step']:7.1f} ms ({1e3 * minor:+6.2f}, {100 * minor / base:+5.2f} %; hooks "
          f"{1e3 * r['projection']:5.2f}) -> {100 * share:+5.2f} % vs base (target <= {target:g} %)", flush=True)


def compare_routes(width: int, batch: int, routes: list[str], args, options: dict) -> dict[str, dict]:
    """Every route and the switch-free baseline in one process, the baseline before and after; returns each
    route's ``measure``."""
    target = 5.0 if batch == 1 else 1.0
    shape = dict(every=args.every, cycles=args.cycles)
    before = baseline_step(width, batch, **shape)
    results = {route: measure(width, batch, args.interval, minor_training=route, **shape, **options)
               for route in routes}
    after = baseline_step(width, batch, **shape)
    base = (before + after) / 2
    print(f"  width {width:4d} batch {batch:2d}x256 base step {1e3 * base:7.1f} ms (before {1e3 * before:.1f}, "
          f"after {1e3 * after:.1f})", flush=True)
    for route, r in results.items():
        report(f"    {route:13s} hooks", r, target)
        report_route(f"    {route:13s} steps", r, base, args.interval, target)
    first, *rest = routes
    for route in rest:
        gap = max(float((a - b).norm() / b.norm()) for a, b in zip(results[route]["weights"], results[first]["weights"]))
        print(f"    {route} vs {first}: {decisions_differ(results[first]['history'], results[route]['history'])}; "
              f"largest relative weight difference at the end {gap:.1e}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="128,256,512")
    parser.add_argument("--batches", default="1,16", help="batch sizes (sequences of 256 tokens)")
    parser.add_argument("--interval", type=int, default=100, help="steps between SVD cycles (the default: 100)")
    parser.add_argument("--every", type=int, default=4, help="cycle spacing in the measured fit")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--svd-method", default=None, help="gram | full | randomized (default: the callback's)")
    parser.add_argument("--compare", default=None, metavar="METHOD",
                        help="also run each worst case with this SVD method (e.g. full): its time, and whether "
                             "every decision (state and r per matrix and cycle) is the same")
    parser.add_argument("--default-thresholds", action="store_true",
                        help="add a row per width and batch with the default thresholds (not every matrix minor)")
    parser.add_argument("--minor-training", default="project,project-after", metavar="ROUTES",
                        help="comma-separated routes, each a row against a switch-free baseline fit in the same run: "
                             "project (the default: a minor Linear's projected gradient computed in the backward), "
                             "project-after (skip_full_gradient=False: the full gradient projected after the backward), "
                             "factorize")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--warm-vs-full", action="store_true",
                        help="only the table of the cycle with the full SVD vs the warm start (widths from --widths)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # process CPU time on one thread: comparable on a shared machine
    if args.warm_vs_full:
        warm_vs_full([int(w) for w in args.widths.split(",")], args.interval, args.every, args.cycles)
        return
    options = {} if args.svd_method is None else {"svd": {"method": args.svd_method}}
    print(f"AdaptiveSVDSwitch through trainer.fit's hooks, GPT 4 layers x width, sequence 256, every matrix "
          f"projecting (worst case) unless labelled; one thread, process CPU time; share at interval {args.interval}")
    for width in [int(w) for w in args.widths.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            target = 5.0 if batch == 1 else 1.0
            label = f"width {width:4d} batch {batch:2d}x256"
            results = compare_routes(width, batch, args.minor_training.split(","), args, options)
            if args.compare:  # against the default route's worst case, measured above unless left out
                r = results.get("project") or measure(width, batch, args.interval, args.every, args.cycles, **options)
                other = measure(width, batch, args.interval, args.every, args.cycles,
                                svd={"method": args.compare})
                same = "same decisions" if other["history"] == r["history"] else "DIFFERENT decisions"
                report(f"{label} svd={args.compare} ({same})", other, target)
            if args.default_thresholds:
                d = measure(width, batch, args.interval, args.every, args.cycles, worst_case=False, **options)
                report(f"{label} default thresholds ({d['minor']} of {d['matrices']} minor at the end)", d, target)
    if args.memory:
        memory([64, 32, 8])


if __name__ == "__main__":
    main()
