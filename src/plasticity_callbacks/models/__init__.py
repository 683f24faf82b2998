"""The GPT, its pluggable blocks and its LightningModule."""
from .blocks import KVCache, NeuronLayout
from .gpt import GPT, Block, GPTConfig
from .optimizers import OptimizerSettings
from .registry import ATTENTIONS, MLPS, POSITIONS, Registry

__all__ = [
    "GPT", "GPTConfig", "Block", "KVCache", "NeuronLayout", "ATTENTIONS", "MLPS", "POSITIONS",
    "Registry", "GPTLightningModule", "OptimizerSettings",
]


def __getattr__(name):  # the LightningModule imports Lightning; the bare model does not need it
    if name == "GPTLightningModule":
        from .lightning_module import GPTLightningModule

        return GPTLightningModule
    raise AttributeError(name)
