"""Model blocks; importing this package registers every block under its config name."""
from . import attention, mlp, position  # noqa: F401
from .attention import CausalSelfAttention, KVCache, rms_norm
from .mlp import GatedMLP, GeGLUMLP, MLPBlock, NeuronLayout, ReluSquaredMLP, SwiGLUMLP
from .position import NoPosition, PositionBlock, Rotary

__all__ = [
    "CausalSelfAttention", "KVCache", "rms_norm", "GatedMLP", "GeGLUMLP", "MLPBlock", "NeuronLayout",
    "ReluSquaredMLP", "SwiGLUMLP", "NoPosition", "PositionBlock", "Rotary",
]
