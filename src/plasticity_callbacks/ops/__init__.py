"""A method applied to a model and its optimizer state, as plain functions: no Lightning, no schedule.

The callbacks decide *when*; these do *what*, on any ``nn.Module`` the model map understands. Each one-call
function is what its callback's ``act`` runs, so a plain PyTorch loop (or Fabric) gets the same method:

    fire_(model, optimizer)                           # FIRE: orthogonalize the selected weights, reset their moments
    with ActivationStats(model) as stats: ...         # ReDo: collect the neurons' activity over some steps,
    redo_(model, optimizer, stats, tau=0.1)           #       then recycle the dormant ones
    dash_(model, optimizer, min_factor=0.3)           # DASH: after backward, before the step
    shrink_perturb_(model, optimizer, 0.4, 0.1)       # Shrink & Perturb (0, 1 and reset_optimizer: a full reset)

None of them imports Lightning.
"""
from .dash import dash_
from .fire import apply_fire as fire_
from .fresh import fresh_values
from .optimizer_state import reset_optimizer_state
from .redo import ActivationStats, recycle_, redo_
from .shrink_perturb import shrink_perturb_

__all__ = ["ActivationStats", "dash_", "fire_", "fresh_values", "recycle_", "redo_", "reset_optimizer_state",
           "shrink_perturb_"]
