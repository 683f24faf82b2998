"""The model map: what every plasticity callback may act on, for any ``nn.Module``.

* :func:`select_targets` -> :class:`WeightView` per treatable weight (orientation, fused row
  blocks, role, kind, factorization);
* :func:`find_neuron_layers` -> :class:`NeuronLayer` per MLP/CNN hidden layer (ReDo);
* :func:`output_heads` -> the output layer(s), tied or not, never treated by default;
* :func:`fresh_parameters` -> a fresh initialization by the model's own init code (ShrinkPerturb);
* :func:`declare_plasticity` -> the one way to describe anything the built-in adapters miss;
* :func:`describe` -> a readable summary of all of the above for one model.

Built in: ``nn.Linear``, conv, HF ``Conv1D``, ``nn.MultiheadAttention``/``TransformerEncoderLayer``,
Hugging Face GPT-2, Llama/Mistral (gated MLP, GQA) and BERT-style encoders, and this package's GPT.
"""
from .declaration import Declaration, declare_plasticity
from .fresh import fresh_layer_weight, fresh_parameters
from .neurons import NeuronLayer
from .select import (
    SCOPES,
    Selection,
    describe,
    find_neuron_layers,
    refuse_factorized,
    require_targets,
    select_targets,
    validate_patterns,
)
from .weights import Block, Target, WeightView, is_conv1d, output_head, output_heads

__all__ = [
    "Block", "Declaration", "NeuronLayer", "SCOPES", "Selection", "Target", "WeightView", "declare_plasticity", "describe",
    "find_neuron_layers", "fresh_layer_weight", "fresh_parameters", "is_conv1d", "output_head", "output_heads", "refuse_factorized",
    "require_targets", "select_targets", "validate_patterns",
]
