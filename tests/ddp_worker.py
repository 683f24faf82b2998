"""DDP runs on 2 CPU processes (gloo), one after another in one launch, started by ``ddp_harness.run_ddp_many``.

Lightning's DDP launcher re-runs this script for rank 1. For each run each rank saves its parameters,
optimizer state and logged metrics to ``<out>/<run name>/rank<r>.pt`` for the test to compare; then every rank
ends through :func:`rank_exit.exit_after_results`.
"""
import json
import sys
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))
from rank_exit import exit_after_results  # noqa: E402
from tiny import build  # noqa: E402


def main(spec_path: str) -> None:
    """Every run of ``spec["runs"]`` in turn, on the one process group (a launch costs two interpreters' start
    and the group's set-up; the runs share them)."""
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        print(f"ddp_worker: run {run['name']}", flush=True)  # which run a failed launch was in
        train(run, Path(spec["out"]) / run["name"])


def train(spec: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(spec.get("seed", 0), workers=True)
    module, loader = build(spec.get("model", "mlp"), spec.get("optimizer", "adamw"))
    callbacks = [instantiate(c) for c in spec.get("callbacks", [])]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=spec.get("steps", 6),
        accumulate_grad_batches=spec.get("accumulate", 1), callbacks=callbacks,
        logger=CSVLogger(out, name="logs", version=""), log_every_n_steps=1, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
    )
    trainer.fit(module, train_dataloaders=loader)
    optimizer = trainer.optimizers[0]
    torch.save(
        {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "optimizer": optimizer.state_dict(),
            "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
        },
        out / f"rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1])
    exit_after_results()
