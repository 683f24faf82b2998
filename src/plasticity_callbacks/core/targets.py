"""Target selection lives in the model map (:mod:`plasticity_callbacks.core.model_map`); these
names stay importable from here."""
from .model_map import (  # noqa: F401
    SCOPES,
    Target,
    WeightView,
    output_head,
    output_heads,
    require_targets,
    select_targets,
    validate_patterns,
    validate_selection,
)
