"""The model map: what every plasticity callback may act on, for any ``nn.Module``.

* :func:`select_targets` -> :class:`WeightView` per treatable weight (orientation, fused row
  blocks as :class:`RowBlock` index sets, conv groups, role, kind, factorization);
* :func:`find_neuron_layers` -> :class:`HiddenUnits` per MLP/CNN hidden layer (ReDo);
* :func:`output_heads` -> the output layer(s), tied or not, never treated by default;
* :func:`fresh_parameters` -> a fresh initialization by the model's own init code (ShrinkPerturb);
* :func:`declare_plasticity` -> the one way to describe anything the built-in adapters miss;
* :func:`coverage_report` -> every >=2-D parameter, treated (with its blocks) or not (with the reason);
  :func:`describe` prints it with the neuron layers.

Built in: ``nn.Linear``, conv (grouped, depthwise, transposed), HF ``Conv1D``, ``nn.LSTM``/``GRU``/``RNN``,
``nn.MultiheadAttention``; fused Q/K/V splits are read from the model's forward (:mod:`.probe`), the cuts of
every other layer's output and bare parameters used as linear maps (routers, 3-D expert stacks) by a trace
of it (:mod:`.trace`, :mod:`.stacks`).
"""
from .coverage import coverage_report, describe
from .declaration import Declaration, declare_plasticity
from .fresh import fresh_layer_weight, fresh_parameters
from .layouts import HeadLayout, Interleaved, RowBlock, grouped_heads, interleaved_heads, linear_map, stacked_matrices
from .neurons import HiddenUnits
from .select import (
    SCOPES,
    Selection,
    check_layer_map,
    find_neuron_layers,
    refuse_factorized,
    refuse_parametrized,
    refuse_unknown_splits,
    require_patterns_match,
    require_targets,
    select_targets,
    validate_patterns,
)
from .weights import WeightView, is_conv1d, output_heads

__all__ = [
    "Declaration", "HeadLayout", "HiddenUnits", "Interleaved", "RowBlock", "SCOPES", "Selection", "WeightView",
    "check_layer_map", "coverage_report", "declare_plasticity", "describe", "find_neuron_layers", "fresh_layer_weight",
    "fresh_parameters", "grouped_heads", "interleaved_heads", "is_conv1d", "linear_map", "output_heads",
    "refuse_factorized", "refuse_parametrized", "refuse_unknown_splits", "require_patterns_match", "require_targets",
    "select_targets", "stacked_matrices", "validate_patterns",
]
