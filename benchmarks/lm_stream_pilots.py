"""Screens designs of the language-model task stream (``data/lm_stream.py``) for loss of plasticity:
does warm start end the stream below full reset?

Each run trains the package GPT on one :class:`~plasticity_callbacks.data.lm_stream.LMTaskStream`
with a plain loop (the same batches the Trainer would see), once per arm: ``warm`` (weights and Adam
moments carry over), ``reset`` (a fresh GPT init and a fresh Adam at every boundary), ``warm_new_head``
(warm, but the output head back to its init, zero, with its Adam moments dropped, at every boundary).
It prints one row per arm: the end-of-task accuracy and loss on the task's targets (``eval_data``), first and last ``k``
tasks, and the CPU seconds the arm took (``time.process_time``, robust to a shared machine).

    python benchmarks/lm_stream_pilots.py --design random_last_byte --tasks 20 --steps 100 --lr 1e-2
    python benchmarks/lm_stream_pilots.py --design slices --slice-bytes 4000 2000000 --steps 1000 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from plasticity_callbacks.data.digits import StreamBatches
from plasticity_callbacks.data.lm_stream import LMTaskStream
from plasticity_callbacks.data.tokenizer import IGNORE_INDEX
from plasticity_callbacks.models.gpt import GPT, GPTConfig


def masked_scores(logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(accuracy, loss) over the targets of ``y`` that are not ``IGNORE_INDEX``."""
    keep = y != IGNORE_INDEX
    logits, y = logits[keep], y[keep]
    return float((logits.argmax(-1) == y).float().mean()), float(F.cross_entropy(logits, y))


def fresh_model(args, seed: int, task: int) -> GPT:
    torch.manual_seed(seed * 1000 + task)
    config = GPTConfig(n_layer=args.layers, n_head=args.heads, n_kv_head=args.heads, n_embd=args.width,
                       sequence_len=args.window, mlp=args.mlp)
    return GPT(config)


def run_arm(args, arm: str, seed: int) -> dict:
    design = {"name": args.design, "windows_per_task": args.windows, "fresh_windows": not args.fixed_windows,
              "slice_bytes": args.slice_bytes}
    stream = LMTaskStream(design=design, num_tasks=args.tasks, steps_per_task=args.steps, batch_size=args.batch,
                          seed=seed, window=args.window, corpus_max_bytes=args.corpus_bytes)
    batches = StreamBatches(stream)
    started = time.process_time()
    model, optimizer, rows = None, None, []
    for task in range(stream.num_tasks):
        if model is None or arm == "reset":
            model = fresh_model(args, seed, task)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.wd)
        elif arm == "warm_new_head":
            with torch.no_grad():
                model.lm_head.weight.zero_()  # the GPT's init of its head
            optimizer.state.pop(model.lm_head.weight, None)
        online = []
        for step in range(task * stream.steps_per_task, (task + 1) * stream.steps_per_task):
            x, y = batches[step]
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            online.append(float(loss.detach()))
        model.eval()
        with torch.no_grad():
            accuracy, eval_loss = masked_scores(model(stream.eval_data(task)[0]), stream.eval_data(task)[1])
        model.train()
        rows.append({"task": task, "accuracy": accuracy, "loss": eval_loss,
                     "online_loss": sum(online) / len(online)})
    return {"arm": arm, "seed": seed, "rows": rows, "cpu_s": time.process_time() - started}


def summary(result: dict, k: int) -> str:
    rows = result["rows"]
    first, last = rows[:k], rows[-k:]
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return (f"{result['arm']:6s} seed {result['seed']}: acc first {mean(first, 'accuracy'):.3f} last "
            f"{mean(last, 'accuracy'):.3f} | loss first {mean(first, 'loss'):.3f} last {mean(last, 'loss'):.3f} | "
            f"online loss last {mean(last, 'online_loss'):.3f} | {result['cpu_s']:.0f} CPU s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--design", default="random_last_byte")
    parser.add_argument("--tasks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--windows", type=int, default=256, help="random_last_byte: windows per task")
    parser.add_argument("--fixed-windows", action="store_true")
    parser.add_argument("--slice-bytes", type=int, nargs="*", default=None)
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--mlp", default="relu2")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--wd", type=float, default=0.0)
    parser.add_argument("--seeds", type=int, nargs="*", default=[0])
    parser.add_argument("--arms", nargs="*", default=["warm", "reset"])
    parser.add_argument("--k", type=int, default=5, help="tasks averaged at each end")
    parser.add_argument("--json", default=None, help="append every result as a JSON line to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(json.dumps({k: v for k, v in vars(args).items() if k != "json"}))
    for seed in args.seeds:
        for arm in args.arms:
            result = run_arm(args, arm, seed)
            print(summary(result, min(args.k, args.tasks)), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"settings": vars(args), **result}) + "\n")


if __name__ == "__main__":
    main()
