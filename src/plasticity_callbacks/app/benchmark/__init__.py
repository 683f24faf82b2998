"""``plasticity-benchmark``: the task-stream ranking of the plasticity methods (``main.py``).

Every method of ``configs/method/`` (a user's too, with ``--config-dir``) runs on two digits streams,
memorization (random labels) and generalization (permuted digits, held-out accuracy), on the ranking
seeds, at its method file's setting and, where its ``sensitivity:`` sweep finds a better one on the
tuning seeds, at that one too; the table ranks by end-of-task accuracy over the last tasks, with
seed-paired differences from warm start and full reset. The parts: ``metrics`` (the numbers),
``results`` (the per-seed file the package ships), ``runs`` (the fits), ``table`` and ``figure``.
"""
