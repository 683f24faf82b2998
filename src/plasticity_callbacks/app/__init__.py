"""The application: the Hydra entry point (``plasticity-train``), the multi-phase pipeline and
the sweep report (``plasticity-report``). It needs the ``[app]`` extra (Hydra, OmegaConf, matplotlib)."""
from ..extras import require_module

for _module in ("hydra", "omegaconf", "matplotlib"):
    require_module(_module, "app", "the Hydra app (plasticity-train, plasticity-report)")
