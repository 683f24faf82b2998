"""How every rank process of a test ends once its results are written: ``exit_after_results()``.

:func:`~plasticity_callbacks.distributed.process_group.end_process_group` (a barrier, then the group destroyed)
narrows but cannot close the exit race it describes: gloo's worker threads outlive the group, and one that
releases a collective's tensor while the interpreter finalizes aborts the process (exit -6) after a run that
succeeded. A test's rank has nothing left to do after that barrier: its results are on disk and closed, and
every other rank has reached the same point. It ends there with ``os._exit``, which skips the interpreter's
finalization, the only place the race can strike (no atexit handler of a test worker is needed: Lightning's
loggers and checkpoints are written when the fit ends).

    main(spec)               # writes the results
    exit_after_results()     # every rank; the process ends here with status 0
"""
from __future__ import annotations

import os
import sys

from plasticity_callbacks.distributed.process_group import end_process_group


def exit_after_results() -> None:
    """Barrier and destroyed process group on every rank, streams flushed, then the process ends (status 0)."""
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
