"""Ending a multi-process run: every rank meets at a barrier, then the process group is destroyed.

Lightning leaves a gloo process group up when a fit ends (it registers an exit hook for NCCL only), so each
rank used to leave its program straight after its last collective, without waiting for the others. A gloo
worker thread may still be releasing that collective's tensors; if it releases one that Python created
while the interpreter is finalizing, taking the GIL ends the thread inside a C++ destructor and the process
aborts ("terminate called without an active exception", exit status -6) after a run that succeeded.
Ending with :func:`end_process_group` moves the exit a full barrier away from the last collective and makes
the launching rank (the one a scheduler waits on) finish only after every rank reached the end of its run.
It cannot join gloo's threads: ``destroy_process_group`` shuts no gloo thread down, and DTensor's caches keep
the groups of a device mesh alive until the interpreter ends.

Example:
    >>> trainer.fit(module)
    >>> end_process_group()  # last line of the program on every rank; nothing without a process group
"""
from __future__ import annotations


def end_process_group() -> None:
    """Wait for every rank at a barrier, then destroy the default process group and every group made from it.

    Call it on every rank, after the rank's last collective and its last write; a rank that never calls it
    (it failed) makes the others fail at the barrier when its connections close. Nothing happens when no
    process group is up (one process).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    dist.destroy_process_group()
