"""Tiny LightningModules and data for callback tests: an MLP, a CNN and a small GPT.

Callbacks must work on any LightningModule with Linear/conv layers, so tests use all three.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from plasticity_callbacks.models import GPTLightningModule

OPTIMIZERS = ("adamw", "sgd", "muon")


def recycle(up: nn.Module, down: nn.Module, mask: torch.Tensor, gate: nn.Module | None = None, init="weight_std",
            optimizer=None, generator=None, down_offset: int = 0, group: int = 1, norm=None) -> torch.Tensor:
    """Recycle one layer's masked neurons: fresh incoming rows, zero outgoing columns; return the count."""
    from plasticity_callbacks.ops.neuron_reset import reinit_incoming, zero_outgoing

    count = reinit_incoming(up, mask, gate, init, optimizer, generator, norm)
    zero_outgoing(down, mask, optimizer, down_offset, group)
    return count


def make_optimizer(module: nn.Module, name: str, lr: float):
    if name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=lr)
    if name == "sgd":
        return torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    if name == "muon":  # Muon for matrices, AdamW for the rest, stepped as one
        from plasticity_callbacks.models.optimizers import CombinedOptimizer

        matrices = [p for p in module.parameters() if p.dim() == 2]
        rest = [p for p in module.parameters() if p.dim() != 2]
        return CombinedOptimizer([torch.optim.Muon(matrices, lr=lr), torch.optim.AdamW(rest, lr=lr)])
    raise ValueError(name)


class TinyMLPModule(L.LightningModule):
    """``Linear → ReLU → Linear → ReLU → Linear`` regression; the last Linear is the head."""

    def __init__(self, d_in: int = 8, hidden: int = 16, d_out: int = 4, optimizer: str = "adamw", lr: float = 1e-2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, d_out)
        )
        self.optimizer_name, self.lr = optimizer, lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y))

    def configure_optimizers(self):
        return make_optimizer(self, self.optimizer_name, self.lr)


class TinyCNNModule(L.LightningModule):
    """Two conv layers and a linear head on 8×8 images, 3 classes."""

    def __init__(self, optimizer: str = "adamw", lr: float = 1e-2):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(8, 3)
        self.optimizer_name, self.lr = optimizer, lr

    def forward(self, x):
        return self.head(self.features(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return make_optimizer(self, self.optimizer_name, self.lr)


def tiny_gpt_module(optimizer: str = "adamw", **model_overrides) -> GPTLightningModule:
    config = dict(n_layer=2, n_head=2, n_kv_head=2, n_embd=32, sequence_len=16)
    config.update(model_overrides)
    return GPTLightningModule(config, {"name": optimizer, "lr": 1e-2, "schedule": "constant"})


def regression_loader(n: int = 64, d_in: int = 8, d_out: int = 4, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g)
    y = torch.tanh(x @ torch.randn(d_in, d_out, generator=g))
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def image_loader(n: int = 48, batch_size: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 8, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def token_loader(n: int = 32, sequence_len: int = 16, vocab: int = 256, batch_size: int = 4, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, sequence_len + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch_size)


def build(kind: str, optimizer: str = "adamw"):
    """``(module, train_loader)`` for ``kind`` in ``mlp | cnn | gpt``."""
    if kind == "mlp":
        return TinyMLPModule(optimizer=optimizer), regression_loader()
    if kind == "cnn":
        return TinyCNNModule(optimizer=optimizer), image_loader()
    if kind == "gpt":
        return tiny_gpt_module(optimizer=optimizer), token_loader()
    raise ValueError(kind)


def cpu_trainer(**kwargs) -> L.Trainer:
    """A quiet single-process CPU trainer; pass max_steps, callbacks, etc."""
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return L.Trainer(**defaults)
