"""Training runs for the crash-and-resume tests, each in a process of its own (``resume_harness``).

``python resume_worker.py spec.json`` runs every entry of ``spec["runs"]`` in order. A run trains
a tiny model (tests/tiny.py) with a shuffling ``ResumableDataLoader``, Hydra ``_target_``
callbacks, a ``ModelCheckpoint`` every ``ckpt_every`` steps (``last.ckpt`` too) and the project's CSV
logger config (configs/logger/csv.yaml). ``stop_at`` interrupts it when optimizer step ``stop_at``
is about to start (so the checkpoint of that step is on disk), or with ``at="validation"`` when the
validation after step ``stop_at`` starts: ``how="raise"`` raises, ``how="wait"`` writes ``<out>/ready``
and waits for a signal. ``resume: true`` continues with ``ckpt_path="last"``, keeping the metric
rows logged up to that checkpoint (``LogPosition``, ``restore_logs``). Each run that finishes
saves ``<out>/result.pt``.
"""
import csv
import json
import sys
import time
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint

sys.path.insert(0, str(Path(__file__).parent))
from tiny import build  # noqa: E402

from plasticity_callbacks.app.runs.resumed_logs import LogPosition, restore_logs  # noqa: E402
from plasticity_callbacks.data.sampler import ResumableDataLoader  # noqa: E402


class Interrupted(Exception):
    """The planned interruption of a run (stands in for a crash)."""


class Interrupt(L.Callback):
    def __init__(self, step: int, how: str, out: Path | str, at: str = "batch"):
        self.step, self.how, self.out, self.at = step, how, Path(out), at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.at == "batch":
            self.interrupt(trainer)

    def on_validation_start(self, trainer, pl_module):
        if self.at == "validation" and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.interrupt(trainer)

    def interrupt(self, trainer):
        if trainer.global_step != self.step:
            return
        if self.how == "raise":
            raise Interrupted(f"stopped at step {self.step}")
        (self.out / "ready").write_text(str(trainer.global_step))
        deadline = time.monotonic() + 120
        while not trainer.received_sigterm and time.monotonic() < deadline:  # SIGKILL ends it here
            time.sleep(0.05)


def project_logger(out: Path):
    """The logger of ``plasticity-train`` (configs/logger/csv.yaml), writing under ``out``: the SIGKILL
    test checks that config, not a test-only setting."""
    from omegaconf import OmegaConf

    from plasticity_callbacks.app.train import config_dir

    cfg = OmegaConf.load(Path(config_dir()) / "logger" / "csv.yaml")
    cfg.save_dir = str(out)
    return instantiate(cfg)


def state_of(callback) -> dict:
    try:
        return callback.state_dict()
    except Exception as err:  # a broken state_dict must fail the test, not the worker
        return {"state_dict_error": repr(err)}


def run_pipeline(spec: dict) -> None:
    """The Hydra multi-phase pipeline (pipeline.py) composed from ``spec["overrides"]``; with
    ``stop_at``, phase ``stop_phase`` is interrupted at that step; ``resume`` sets pipeline.resume."""
    from plasticity_callbacks.app.pipeline import Pipeline
    from hydra_app import compose_config

    out = Path(spec["out"])
    overrides = [*spec["overrides"], f"paths.output_dir={out}", f"pipeline.resume={bool(spec.get('resume'))}"]
    if spec.get("stop_at") is not None:
        overrides.append(f"+phases.{spec['stop_phase']}.callbacks.interrupt={{_target_: resume_worker.Interrupt, "
                         f"step: {spec['stop_at']}, how: raise, out: '{out}', at: {spec.get('at', 'batch')}}}")
    if spec.get("resume"):  # the interruption is the one intended change of configuration
        overrides.append(f"resume_allow_changes=[phases.{spec['stop_phase']}.callbacks.interrupt]")
    cfg = compose_config(*overrides, output_dir=None)
    try:
        Pipeline(cfg).run()
    except Interrupted:
        return
    final = torch.load(out / "checkpoints" / spec["final_phase"] / "final.ckpt", weights_only=False)
    with open(out / "logs" / spec["final_phase"] / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    torch.save({"params": final["state_dict"], "buffers": {}, "optimizer": final["optimizer_states"],
                "callbacks": [v for k, v in sorted(final["callbacks"].items())
                              if "ModelCheckpoint" not in k and not k.startswith("ResumeGuard")],
                "global_step": final["global_step"], "metrics": {}, "rows": rows}, out / "result.pt")


def run(spec: dict) -> None:
    if spec.get("kind") == "pipeline":
        return run_pipeline(spec)
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    L.seed_everything(spec.get("seed", 0), workers=True)
    module, plain = build(spec.get("model", "mlp"), spec.get("optimizer", "adamw"))
    loader = ResumableDataLoader(plain.dataset, batch_size=plain.batch_size, seed=spec.get("seed", 0))
    callbacks = [instantiate(c) for c in spec.get("callbacks", [])]
    if spec.get("stop_at") is not None:
        callbacks.append(Interrupt(spec["stop_at"], spec.get("how", "raise"), out))
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", filename="step{step}", every_n_train_steps=spec["ckpt_every"],
                                 save_top_k=-1, save_last=True)
    logger, last = project_logger(out), out / "checkpoints" / "last.ckpt"
    if spec.get("resume") and last.is_file():  # the rows up to the checkpoint, once, as plasticity-train keeps them
        restore_logs(logger, torch.load(last, weights_only=True, mmap=True))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=spec["steps"], callbacks=[*callbacks, LogPosition(), checkpoint],
        logger=logger, log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, deterministic=True,
        accumulate_grad_batches=spec.get("accumulate", 1),
    )
    try:
        trainer.fit(module, train_dataloaders=loader, ckpt_path="last" if spec.get("resume") else None)
    except Interrupted:
        return
    torch.save({
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
        "optimizer": trainer.optimizers[0].state_dict(),
        "callbacks": [state_of(c) for c in callbacks],
        "global_step": trainer.global_step,
        "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
    }, out / "result.pt")


def main(spec_path: str) -> None:
    torch.set_num_threads(1)
    sys.modules.setdefault("resume_worker", sys.modules[__name__])  # Hydra's _target_ finds these classes
    for spec in json.loads(Path(spec_path).read_text())["runs"]:
        run(spec)


if __name__ == "__main__":
    main(sys.argv[1])
