"""The application: the Hydra entry point (``plasticity-train``), the multi-phase pipeline and
the sweep report (``plasticity-report``). Its entry points need the ``[app]`` extra (Hydra, OmegaConf,
matplotlib) and say so in one line when it is missing; ``app.runs`` (verified checkpoints, resume) needs
only Lightning."""
