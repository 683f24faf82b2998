"""``GPTLightningModule``: next-token training of the GPT with Lightning."""
from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from ..data.tokenizer import IGNORE_INDEX
from .optimizers import OptimizerSettings, build_optimizer, lr_lambda
from .gpt import GPT, GPTConfig
from ..errors import ConfigError


class GPTLightningModule(L.LightningModule):
    """Trains a :class:`GPT` on ``(x, y)`` batches; labels equal to ``IGNORE_INDEX`` (-100) are skipped.

    Logs ``train/loss``, ``train/tokens_per_sec``, ``val/loss``, ``val/ppl``.

    With ``model.compile=True`` the training forward runs through ``torch.compile`` (static
    shapes); validation, generation and callbacks' own forwards stay eager, because a second
    (eval) graph costs more to compile than a few validation batches save. The compiled
    callable wraps ``self.model.forward``, so parameter names and checkpoints are the eager
    model's, and a new module (the next phase of a pipeline) reuses the graph. Weight edits in
    place (FIRE, DASH, Shrink & Perturb, ReDo's recycling) need no re-trace; ReDo reads neurons
    through the MLPs' ``hidden_observer`` (one extra graph for its collecting steps), since
    module hooks added after the first compiled step are not seen; AdaptiveSVD's factorize mode
    re-traces when the structure or a rank changes.

    Args:
        model: a ``GPTConfig`` or a dict of its fields.
        optimizer: the optimizer and its LR schedule: :class:`~models.optimizers.OptimizerSettings` or a dict of
            its fields (``configs/optimizer/<name>.yaml``); None: AdamW at 3e-3, cosine.

    Raises:
        ConfigError: an optimizer setting out of range, naming it (``optimizer.lr=-1 ...``).

    Example:
        >>> module = GPTLightningModule({"n_layer": 2, "n_embd": 64, "mlp": "swiglu"}, {"name": "muon", "lr": 3e-3})
        >>> L.Trainer(max_steps=100).fit(module, datamodule=CodeCorpusDataModule())
    """

    def __init__(self, model: GPTConfig | dict[str, Any] | None = None,
                 optimizer: OptimizerSettings | dict[str, Any] | None = None):
        super().__init__()
        config = model if isinstance(model, GPTConfig) else GPTConfig(**dict(model or {}))
        try:
            self.optimizer_settings = OptimizerSettings.build(optimizer)
        except ValueError as err:  # a config's value: one line naming the key (optimizer.<field>)
            raise ConfigError(str(err)) from None
        self.save_hyperparameters({"model": config.to_dict(), "optimizer": asdict(self.optimizer_settings)})
        self.model = GPT(config)
        # A plain function attribute, not a submodule: state_dict keys and named_modules() stay the model's.
        self._compiled_forward = torch.compile(self.model.forward, dynamic=False) if config.compile else None
        self.val_loss = MeanMetric()
        self.val_ppl = Perplexity(ignore_index=IGNORE_INDEX)
        self._last_step_end: float | None = None  # train/tokens_per_sec's clock

    @property
    def config(self) -> GPTConfig:
        return self.model.config

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): shard every block, then the embeddings and head, on the
        data-parallel mesh; each parameter becomes a ``DTensor`` sharded on dim 0. Otherwise nothing."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self._device_mesh is None or isinstance(self.model, FSDPModule):  # not FSDP2, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A checkpoint whose block scalars (gates, pathway weights, ``α``) were stored 0-d resumes: their
        weights load through the blocks' own hook, and their optimizer moments, the only 0-d per-parameter
        optimizer state of this model (a ``step`` count is 0-d for every parameter), become ``(1,)`` too."""
        for optimizer_state in checkpoint.get("optimizer_states", []):
            for state in optimizer_state.get("state", {}).values():
                for key, value in state.items():
                    if key != "step" and torch.is_tensor(value) and value.dim() == 0:
                        state[key] = value.reshape(1)

    def setup(self, stage: str) -> None:
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if datamodule is not None:
            check_data_fits_model(datamodule, self.config)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self.model(x) if self._compiled_forward is None else self._compiled_forward(x)
        loss = self.loss(logits, y)
        self.log("train/loss", loss, prog_bar=True)
        with torch.no_grad():  # next-byte accuracy on the counted targets: TaskMetrics averages it over a task
            counted = y != IGNORE_INDEX  # a sum, not a boolean index: no wait for the GPU inside the step
            accuracy = ((logits.argmax(-1) == y) & counted).sum() / counted.sum()
        return {"loss": loss, "accuracy": accuracy}

    def hidden_activations(self, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Every MLP's hidden units as they enter its ``c_proj``, in layer order, as ``(name, (B·T, hidden))``:
        one row per sample and position; the last is the final hidden layer (TaskMetrics' dormancy and
        feature rank). Read through the MLPs' ``hidden_observer`` during one forward; an observer already
        set (ReDo's) is put back afterwards and does not see this forward."""
        out: list[tuple[str, torch.Tensor]] = []
        mlps = [(f"model.blocks.{i}.mlp", block.mlp) for i, block in enumerate(self.model.blocks)
                if hasattr(block.mlp, "hidden_observer")]
        if not mlps:
            raise ValueError(f"hidden_activations: model.mlp={self.config.mlp!r} exposes no hidden_observer")
        saved = [mlp.hidden_observer for _, mlp in mlps]
        for name, mlp in mlps:
            mlp.hidden_observer = lambda _, h, name=name: out.append((name, h.flatten(0, -2)))  # (B·T, hidden)
        try:
            self.model(x)
        finally:
            for (_, mlp), observer in zip(mlps, saved):
                mlp.hidden_observer = observer
        return out

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        # From one step's end to the next: the whole step (data, optimizer, callbacks). On a GPU a clock read
        # inside a step would time the host's kernel launches; from end to end the host is paced by the GPU
        # once its queue is full, so the rate is the GPU's with no synchronize. The first step of an epoch
        # and the first after validation are not logged (the interval would hold the pause).
        now = time.perf_counter()
        if self._last_step_end is not None and now > self._last_step_end:
            self.log("train/tokens_per_sec", batch[0].numel() / (now - self._last_step_end))
        self._last_step_end = now

    def on_train_epoch_start(self) -> None:
        self._last_step_end = None

    def on_validation_end(self) -> None:
        self._last_step_end = None

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.val_loss.update(self.loss(logits, y), weight=(y != IGNORE_INDEX).sum())
        self.val_ppl.update(logits, y)
        self.log("val/loss", self.val_loss, prog_bar=True)
        self.log("val/ppl", self.val_ppl)

    def configure_optimizers(self):
        settings = self.optimizer_settings
        optimizer = build_optimizer(self.model, settings)
        total = int(self.trainer.estimated_stepping_batches) if self._trainer is not None else 1
        factor = lr_lambda(settings.schedule, max(1, total), settings.warmup_steps, settings.min_lr_ratio,
                           settings.restart_every_n_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def check_data_fits_model(datamodule, config: GPTConfig) -> None:
    """Fail early, naming the fields, when the data cannot be fed to the model."""
    seq = getattr(datamodule, "sequence_len", None)
    if seq is not None and seq > config.sequence_len:
        raise ConfigError(f"data.sequence_len={seq} is larger than model.sequence_len={config.sequence_len}")
    vocab = getattr(datamodule, "vocab_size", None)
    if vocab is not None and vocab > config.vocab_size:
        raise ConfigError(f"the tokenizer has {vocab} tokens but model.vocab_size={config.vocab_size}; "
                          f"set model.vocab_size >= {vocab}")
