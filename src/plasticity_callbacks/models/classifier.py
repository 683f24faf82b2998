"""``DigitsClassifier``: a small MLP or CNN on 8×8 digits, for the task-stream benchmarks.

Both networks are one ``nn.Sequential`` ending in the output layer, so the callbacks find
their weights without help: the last Linear is the output head (``model_map.output_heads``), and every
``Linear/conv → ReLU → Linear/conv`` run is a layer of neurons for ReDo. ``norm="layer"`` adds a layer
norm before each hidden ReLU, and ``weight_decay`` Adam's L2 penalty: the baselines ``method/ln_wd.yaml``
and ``method/l2.yaml`` set them. ``norm="batch"`` with ``optimizer="sgd"`` is DASH's own regime (BatchNorm
nets trained by SGD with momentum; ``experiment/dash_regime.yaml``, docs/dash_regime.md).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from ..data.digits import CLASSES, PIXELS

ARCHITECTURES = ("mlp", "cnn")
NORMS = ("none", "layer", "batch")
OPTIMIZERS = ("adam", "sgd")


def norm_layer(norm: str, features: int, conv: bool = False) -> list[nn.Module]:
    """``[]`` for ``none``; for ``layer``: ``LayerNorm(features)`` after a Linear layer, and after a conv layer
    ``GroupNorm(1, channels)``, the layer norm of a feature map (over each image's channels and positions);
    for ``batch``: ``BatchNorm1d(features)`` / ``BatchNorm2d(channels)`` (statistics over the batch, and over
    the positions of a feature map). Every one with the usual learned gain and bias."""
    if norm == "none":
        return []
    if norm == "batch":
        return [nn.BatchNorm2d(features) if conv else nn.BatchNorm1d(features)]
    return [nn.GroupNorm(1, features) if conv else nn.LayerNorm(features)]


def mlp(widths: Sequence[int] = (256, 256, 256), in_features: int = PIXELS, classes: int = CLASSES,
        norm: str = "none") -> nn.Sequential:
    """``in → widths[0] → … → widths[-1] → classes``, ReLU between layers; ``norm`` puts a norm of the
    pre-activations before each ReLU (Linear → LayerNorm/BatchNorm1d → ReLU), none on the output."""
    layers, previous = [], in_features
    for width in widths:
        layers += [nn.Linear(previous, width), *norm_layer(norm, width), nn.ReLU()]
        previous = width
    return nn.Sequential(*layers, nn.Linear(previous, classes))


def small_cnn(channels: Sequence[int] = (16, 32), hidden: int = 128, classes: int = CLASSES,
              norm: str = "none") -> nn.Sequential:
    """Two 3×3 conv layers on the 8×8 image, a 2×2 max-pool, one hidden Linear layer, the output layer;
    ``norm`` puts a norm before each ReLU (:func:`norm_layer`)."""
    c1, c2 = channels
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),  # (B, 64) -> (B, 1, 8, 8)
        nn.Conv2d(1, c1, 3, padding=1), *norm_layer(norm, c1, conv=True), nn.ReLU(),  # (B, c1, 8, 8)
        nn.Conv2d(c1, c2, 3, padding=1), *norm_layer(norm, c2, conv=True), nn.ReLU(),  # (B, c2, 8, 8)
        nn.MaxPool2d(2), nn.Flatten(),  # (B, c2 * 16)
        nn.Linear(c2 * 16, hidden), *norm_layer(norm, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class DigitsClassifier(L.LightningModule):
    """Cross-entropy classification of flattened 8×8 digits with Adam (or SGD with momentum).

    Args:
        architecture: ``mlp`` (Linear layers of ``widths``) or ``cnn`` (:func:`small_cnn`).
        widths: hidden widths of the MLP.
        channels / hidden: conv channels and hidden width of the CNN.
        lr: the optimizer's learning rate (constant: no schedule).
        norm: ``none``, ``layer`` or ``batch`` (a norm before every hidden ReLU; :func:`norm_layer`).
        weight_decay: the optimizer's ``weight_decay``, an L2 penalty: ``weight_decay · θ`` is added to every
            parameter's gradient before Adam's moments (``torch.optim.Adam``, not the decoupled AdamW), as
            Dohare et al. (2024) run L2 regularization with Adam; SGD adds it the same way. 0 (the default): none.
        optimizer: ``adam`` (the task streams' default) or ``sgd`` (``torch.optim.SGD``, DASH's regime).
        momentum: SGD's momentum in [0, 1); only with ``optimizer="sgd"`` (Adam has its own β's).

    Raises:
        ValueError: a bad argument, naming it and what it may be.

    Example:
        >>> module = DigitsClassifier("mlp", widths=[256, 256, 256], lr=1e-3, norm="layer", weight_decay=1e-3)
        >>> L.Trainer(max_epochs=1).fit(module, datamodule=RandomLabelDigits())
        >>> bn_sgd = DigitsClassifier("mlp", widths=[256, 256], lr=0.01, norm="batch", optimizer="sgd", momentum=0.9)
    """

    def __init__(self, architecture: str = "mlp", widths: Sequence[int] = (256, 256, 256),
                 channels: Sequence[int] = (16, 32), hidden: int = 128, lr: float = 1e-3,
                 norm: str = "none", weight_decay: float = 0.0, optimizer: str = "adam", momentum: float = 0.0):
        super().__init__()
        if architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture={architecture!r} is not one of {ARCHITECTURES}")
        if norm not in NORMS:
            raise ValueError(f"model.norm={norm!r} is not one of {NORMS}")
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not 0 <= weight_decay < math.inf:
            raise ValueError(f"model.weight_decay={weight_decay!r} must be a number >= 0")
        if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
            raise ValueError(f"model.widths={widths!r} must be a non-empty list of positive integers")
        if len(channels) != 2 or any(not isinstance(c, int) or c < 1 for c in channels):
            raise ValueError(f"model.channels={channels!r} must be two positive integers")
        if not (isinstance(lr, (int, float)) and lr > 0):
            raise ValueError(f"model.lr={lr!r} must be a positive number")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"model.optimizer={optimizer!r} is not one of {OPTIMIZERS}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"model.momentum={momentum!r} must be a number in [0, 1)")
        if momentum and optimizer != "sgd":  # silently ignored, it would look like a setting that ran
            raise ValueError(f"model.momentum={momentum!r} is SGD's; with model.optimizer={optimizer!r} leave it 0 "
                             "(or set model.optimizer=sgd)")
        self.save_hyperparameters()
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.optimizer_name, self.momentum = optimizer, float(momentum)
        self.network = (mlp(list(widths), norm=norm) if architecture == "mlp"
                        else small_cnn(list(channels), hidden, norm=norm))
        self.example_input_array = torch.zeros(1, 64)  # one flattened digit: what the model map runs its forward on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)  # (B, 10) logits

    def hidden_activations(self, x: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """Output of every ReLU, in order, as ``(name, activation)``; the last is the final hidden layer.
        Read by hooks during one call of the whole network, so an FSDP2 root unit gathers its weights."""
        out = []
        hooks = [layer.register_forward_hook(lambda _, __, h, name=f"network.{name}": out.append((name, h)))
                 for name, layer in self.network.named_children() if isinstance(layer, nn.ReLU)]
        try:
            self.network(x)
        finally:
            for hook in hooks:
                hook.remove()
        return out

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2): every Linear/conv layer its own unit, then the network,
        on the data-parallel mesh; each weight becomes a ``DTensor`` sharded on dim 0. Otherwise nothing."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if self._device_mesh is None or isinstance(self.network, FSDPModule):  # not FSDP2, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.network:
            if list(layer.parameters()):  # ReLU, pooling and reshapes have nothing to shard
                fully_shard(layer, mesh=mesh)
        fully_shard(self.network, mesh=mesh)

    def training_step(self, batch, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(-1) == y).float().mean()
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/accuracy", accuracy)
        return {"loss": loss, "accuracy": accuracy.detach()}  # TaskMetrics averages both over each task

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # one kernel per op for all tensors; weight_decay: the coupled L2 penalty, on every parameter
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum,
                                   weight_decay=self.weight_decay, foreach=True)
        return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, foreach=True)
