"""Pretrain → SFT in plain Python, with FIRE at the boundary: the pipeline's steps without Hydra.

    python examples/pretrain_then_sft.py                    # ~1 minute on a laptop CPU
    python examples/pretrain_then_sft.py --steps 2 2 --val-batches 1   # a smoke run (the tests run it)

Phase 1 trains a tiny GPT on a few stdlib packages; phase 2 fine-tunes it on instruction/response
pairs with the loss on the response only, starting with FIREReinit (exact polar factor) and
validating on both phases' held-out sets, so the last line shows how much of phase 1 was kept.
"""
import argparse

import lightning as L

from plasticity_callbacks import FIREOptions, FIREReinit, ReDoMonitor
from plasticity_callbacks.data import CodeCorpusDataModule, MultiValidationDataModule, SFTDataModule
from plasticity_callbacks.app.pipeline import PhaseModule

MODEL = dict(n_layer=2, n_embd=64, n_head=2, n_kv_head=2, sequence_len=192)


def trainer(steps: int, val_batches: int, callbacks=()) -> L.Trainer:
    return L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=val_batches,
                     num_sanity_val_steps=0,
                     val_check_interval=steps, check_val_every_n_epoch=None, callbacks=list(callbacks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs=2, default=(200, 100), metavar=("PRETRAIN", "SFT"),
                        help="optimizer steps of each phase")
    parser.add_argument("--val-batches", type=int, default=8, help="validation batches per held-out set")
    options = parser.parse_args()
    (pretrain_steps, sft_steps), val_batches = options.steps, options.val_batches
    L.seed_everything(0)
    code = CodeCorpusDataModule(packages=["json", "csv", "textwrap"], sequence_len=192, batch_size=8)
    pretrain = PhaseModule(MODEL, {"lr": 3e-3, "warmup_steps": 20})
    trainer(pretrain_steps, val_batches).fit(pretrain, datamodule=code)

    # Phase 2: a new module (fresh optimizer and schedule) with phase 1's weights; retention on code.
    sft = PhaseModule(MODEL, {"lr": 1.5e-3, "warmup_steps": 20}, retention_names=["code"])
    sft.load_state_dict(pretrain.state_dict())
    data = MultiValidationDataModule(SFTDataModule(packages=["operator", "numbers", "stat", "asyncio"],
                                                   sequence_len=192, batch_size=8, val_fraction=0.2), {"code": code})
    phase2 = trainer(sft_steps, val_batches, [FIREReinit(options=FIREOptions(method="svd")),
                                 ReDoMonitor(log_every_n_steps=max(1, sft_steps // 2))])
    phase2.fit(sft, datamodule=data)
    metrics = {k: round(float(v), 4) for k, v in phase2.callback_metrics.items() if v.numel() == 1}
    print({k: v for k, v in metrics.items() if k.startswith(("val/loss", "retention", "fire/dfi", "redo/dormant"))})


if __name__ == "__main__":
    main()
