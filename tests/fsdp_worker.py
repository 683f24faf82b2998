"""Runs of a callback under FSDP2 (Lightning's ModelParallelStrategy, 2 CPU ranks, gloo) or on one process.

``python fsdp_worker.py spec.json`` runs every entry of ``spec["runs"]`` on 2 ranks (Lightning's launcher
re-runs this script for rank 1); rank 0 saves ``<out>/<name>.pt``, then every rank ends through
:func:`rank_exit.exit_after_results`. :func:`run` is also called in the test
process with ``devices=1`` for the single-process reference on the same global batch: a rank's batch holds
``batch`` samples and the single process's ``2·batch``, and the sampler deals rank
``r`` the samples ``r, r+2, ...``, so step ``k`` sees samples ``[2k·batch, 2(k+1)·batch)`` either way.

A run: ``{"name", "model": mlp | gpt | digits | digits_root_head | <model_zoo family>, "callbacks": [Hydra dicts], "steps", "lr",
"hidden" (mlp), "optimizer", "batch", "epoch_steps", "ckpt_every", "crash_at", "resume" (a checkpoint path under
``out``), "distributed_checkpoint", "carry_from" (a distributed checkpoint under ``out`` whose optimizer moments
``CarryOptimizerState`` loads at fit start), "val_every" (model-zoo models: one validation batch every that many
training batches; the GPT validates on its training batches), "ddp" (DDP instead of FSDP2), "gpt" (GPTConfig
fields over the tiny ones), "stream" (RandomLabelDigits arguments: the digits classifier trains on that task
stream, whose batches each rank shares)}``; the result: full parameters, full optimizer state by parameter name,
logged metrics and the callbacks' state.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler

sys.path.insert(0, str(Path(__file__).parent))
import model_zoo  # noqa: E402
import tiny  # noqa: E402
from rank_exit import exit_after_results  # noqa: E402


class EveryOtherSample(Sampler):
    """Rank ``r`` of ``w`` takes samples ``r, r+w, ...`` in order (one process: all of them)."""

    def __init__(self, dataset):
        self.size = len(dataset)

    def __iter__(self):
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        return iter(range(rank, self.size, world))

    def __len__(self):
        return self.size


def loader(dataset, batch: int, devices: int) -> DataLoader:
    """Per-rank batches of ``batch`` samples; one process: ``2·batch``, the union of both ranks' batches."""
    per_process = batch * (2 if devices == 1 else 1)
    return DataLoader(dataset, batch_size=per_process, sampler=EveryOtherSample(dataset))


class Sharded(model_zoo.Wrapped):
    """A model-zoo model trained with AdamW, sharded by ``configure_model`` under FSDP2: every
    layer (Linear, conv, HF Conv1D, attention) is its own FSDP unit, then the root."""

    def __init__(self, family: str, lr: float, batch: int, devices: int, optimizer: str):
        super().__init__(family, lr=lr)
        self.batch, self.devices, self.optimizer_name = batch, devices, optimizer

    def configure_model(self):
        shard_every_layer(self)

    def configure_optimizers(self):
        return tiny.make_optimizer(self, self.optimizer_name, self.lr)

    def train_dataloader(self):
        return loader(model_zoo.batches(self.family, n=1, batch=16 * self.batch), self.batch, self.devices)

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", model_zoo.loss_of(self.family, self.model, batch), sync_dist=True)

    def val_dataloader(self):
        return self.train_dataloader()


class ShardedMLP(tiny.TinyMLPModule):
    def configure_model(self):
        shard_every_layer(self)


def _digits_root_head():
    from plasticity_callbacks.models.classifier import DigitsClassifier

    class DigitsRootHead(DigitsClassifier):
        """The digits MLP with its output layer left in the root unit, which an evaluation leaves gathered."""

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.device_mesh is None or isinstance(self.network, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in list(self.network)[:-1]:
                if list(layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.network, mesh=mesh)

    return DigitsRootHead


def shard_every_layer(module: L.LightningModule) -> None:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if module.device_mesh is None or isinstance(getattr(module, "model", module), FSDPModule):
        return
    mesh = module.device_mesh["data_parallel"]
    root = getattr(module, "model", module)  # the module whose forward training_step calls
    tied = {id(m.weight) for m in root.modules() if isinstance(m, nn.Embedding)}  # stay with the root unit
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj: one unit with its parent.
    inside_attention = {id(c) for m in root.modules() if isinstance(m, nn.MultiheadAttention) for c in m.children()}
    for layer in reversed(list(root.modules())):  # children first: a parent's unit takes what is left
        own = list(layer.parameters(recurse=False))
        if (layer is not root and id(layer) not in inside_attention and any(p.dim() >= 2 for p in own)
                and not any(id(p) in tied for p in own)):
            fully_shard(layer, mesh=mesh)
    fully_shard(root, mesh=mesh)


class Crash(L.Callback):
    """Every rank dies (``os._exit``, no clean-up) as step ``at + 1`` begins: after the checkpoint of step
    ``at`` (Lightning runs ``ModelCheckpoint`` after every other callback's ``on_train_batch_end``)."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.at:
            import os

            os._exit(CRASH_EXIT)


CRASH_EXIT = 3


def full(tensor):
    return tensor.full_tensor().detach().clone() if hasattr(tensor, "full_tensor") else tensor.detach().clone()


def whole(state):
    """A callback's state with every tensor whole (FSDP2 keeps some sharded like their parameters)."""
    if isinstance(state, dict):
        return {k: whole(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [whole(v) for v in state]
    return full(state) if torch.is_tensor(state) else state


def build(spec: dict, devices: int):
    batch, model, lr = spec.get("batch", 4), spec.get("model", "mlp"), spec.get("lr", 1e-2)
    samples = 2 * batch * spec.get("epoch_steps", 8)  # global batches of 2·batch samples per epoch
    if model == "mlp":
        return (ShardedMLP(lr=lr, optimizer=spec.get("optimizer", "adamw"), hidden=spec.get("hidden", 16)),
                loader(tiny.regression_loader(n=samples).dataset, batch, devices))
    if model == "gpt":
        from plasticity_callbacks.models import GPTLightningModule

        config = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=32, sequence_len=16) | spec.get("gpt", {})
        return (GPTLightningModule(config, {"lr": lr, "schedule": "constant"}),
                loader(tiny.token_loader(n=samples).dataset, batch, devices))
    if model == "digits":
        from plasticity_callbacks.data.digits import RandomLabelDigits
        from plasticity_callbacks.models.classifier import DigitsClassifier

        return DigitsClassifier(widths=[32, 32], lr=lr), RandomLabelDigits(**spec["stream"])
    if model == "digits_root_head":
        from plasticity_callbacks.data.digits import RandomLabelDigits

        return _digits_root_head()(widths=[32, 32], lr=lr), RandomLabelDigits(**spec["stream"])
    # SGD for attention models: a key bias has a zero gradient (softmax ignores it), and Adam would turn
    # the rounding noise of two reduction orders into full-size, different steps.
    module = Sharded(model, lr, batch, devices, spec.get("optimizer", "adamw"))
    return module, None


def run(spec: dict, out: Path, devices: int) -> dict | None:
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from plasticity_callbacks.app.runs.model_parallel import VerifiedModelParallelStrategy
    from plasticity_callbacks.distributed.sharded_state import reshard

    L.seed_everything(spec.get("seed", 0), workers=True)
    module, data = build(spec, devices)
    callbacks = [instantiate(c) for c in spec.get("callbacks", [])]
    run_dir = out / f"{spec['name']}_{devices}"
    if spec.get("ckpt_every"):
        callbacks.append(ModelCheckpoint(dirpath=run_dir / "ckpt", every_n_train_steps=spec["ckpt_every"],
                                         save_top_k=-1, save_last=True))
    if spec.get("carry_from"):  # a pipeline phase starting from another run's distributed checkpoint
        from plasticity_callbacks.app.pipeline import CarryOptimizerState

        callbacks.insert(0, CarryOptimizerState(folder=out / spec["carry_from"]))
    if spec.get("crash_at"):
        callbacks.append(Crash(spec["crash_at"]))
    steps = spec.get("steps", 4)
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, max_steps=steps, callbacks=callbacks,
        strategy="auto" if devices == 1 else "ddp" if spec.get("ddp") else
        VerifiedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,  # reads its resume as data
                                      save_distributed_checkpoint=spec.get("distributed_checkpoint", False)),
        logger=CSVLogger(run_dir, name="logs", version=""), log_every_n_steps=1,
        enable_checkpointing=bool(spec.get("ckpt_every")), enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True, use_distributed_sampler=False,
        val_check_interval=spec.get("val_every"), limit_val_batches=1 if spec.get("val_every") else 0,
    )
    resume = spec.get("resume")
    if isinstance(data, L.LightningDataModule):
        data = {"datamodule": data}
    else:  # the GPT validates on its training batches when asked to
        validation = data if spec.get("val_every") and data is not None else None
        data = {"train_dataloaders": data, "val_dataloaders": validation}
    trainer.fit(module, **data, ckpt_path=str(out / resume) if resume else None)
    reshard(module)  # a validation at the last step leaves the root unit gathered: its parameters not the optimizer's
    params = {n: full(p) for n, p in module.named_parameters()}
    names = {id(p): n for n, p in module.named_parameters()}
    optimizer = {names[id(p)]: {k: full(v) for k, v in state.items()}
                 for p, state in trainer.optimizers[0].state.items()}
    result = {"params": params, "optimizer": optimizer,
              "metrics": {k: v.detach().clone() for k, v in trainer.callback_metrics.items()},
              "callbacks": [whole(c.state_dict()) for c in callbacks if hasattr(c, "firing") or hasattr(c, "history")]}
    if trainer.global_rank == 0 and devices > 1:
        torch.save(result, out / f"{spec['name']}.pt")
    return result


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for entry in spec["runs"]:
        run(entry, Path(spec["out"]), devices=2)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_after_results()
