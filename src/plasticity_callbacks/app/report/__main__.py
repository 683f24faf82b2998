"""``python -m plasticity_callbacks.app.report RUN_DIR``: the same as ``plasticity-report``."""
from . import main

main()
