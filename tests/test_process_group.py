"""``end_process_group``: every rank's last call in a multi-process run (plasticity-train and the test workers)."""
import socket

import torch
import torch.distributed as dist

from plasticity_callbacks.distributed.process_group import end_process_group


def test_the_process_group_and_its_subgroups_are_destroyed_and_without_one_nothing_happens():
    end_process_group()  # one process, no group: nothing to end, nothing raised
    assert not dist.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        subgroup = dist.new_group([0])
        total = torch.ones(3)
        dist.all_reduce(total, group=subgroup)
        end_process_group()
        assert not dist.is_initialized()
        assert dist.distributed_c10d._world.pg_map == {}  # the subgroup too
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
