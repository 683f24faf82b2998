"""Model blocks; importing this package registers every block under its config name."""
from . import attention
from . import mlp
from . import moe
from . import position
from . import position_bias
from . import reciprocal_attention
from . import reciprocal_mlp
from . import ssm  # noqa: F401
from .attention import CausalSelfAttention, KVCache, rms_norm
from .mlp import GatedMLP, GeGLUMLP, MLPBlock, NeuronLayout, ReluSquaredMLP, SwiGLUMLP
from .moe import MoEMLP
from .position import NoPosition, PositionBlock, Rotary
from .position_bias import ALiBiBias, FIREBias, T5RelativeBias
from .reciprocal_attention import ReciprocalAttention
from .reciprocal_mlp import ReciprocalMLP
from .ssm import Mamba2Mixer

__all__ = [
    "CausalSelfAttention", "KVCache", "rms_norm", "GatedMLP", "GeGLUMLP", "MLPBlock", "NeuronLayout",
    "ReluSquaredMLP", "SwiGLUMLP", "NoPosition", "PositionBlock", "Rotary", "ALiBiBias", "FIREBias",
    "T5RelativeBias", "ReciprocalAttention", "ReciprocalMLP", "Mamba2Mixer", "MoEMLP",
]
