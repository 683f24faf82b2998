"""Ending a multi-process run: every rank meets at a barrier, then the process group is destroyed.

Lightning leaves a gloo process group up when a fit ends (it registers an exit hook for NCCL only). A rank
that leaves its program straight after its last collective can abort after a run that succeeded: a gloo
worker thread may still be releasing that collective's tensors, and if it releases one that Python created
while the interpreter is finalizing, taking the GIL ends the thread inside a C++ destructor ("terminate
called without an active exception", exit status -6). Ending with :func:`end_process_group` puts a full
barrier between the last collective and the exit, and the launching rank (the process a scheduler waits
on) finishes only after every rank has reached the end of its run. It cannot join gloo's threads:
``destroy_process_group`` stops none of them, and DTensor's caches keep a device mesh's groups alive until
the interpreter ends; a program that must rule the race out ends its process once its results are written
(the test workers: ``tests/rank_exit.py``).

Example:
    >>> trainer.fit(module)
    >>> end_process_group()  # last line of the program on every rank; nothing without a process group
"""
from __future__ import annotations


def end_process_group() -> None:
    """Wait for every rank at a barrier, then destroy the default process group and every group made from it.

    Call it on every rank, after the rank's last collective and its last write; a rank that never calls it
    (it failed) makes the others fail at the barrier once its connections close (at the latest, at the
    group's timeout). Nothing happens when no process group is up (one process).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
