"""The application: the Hydra entry point (``plasticity-train``), the multi-phase pipeline and
the sweep report (``plasticity-report``)."""
