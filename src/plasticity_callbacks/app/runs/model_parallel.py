"""Lightning's FSDP2 strategy with a resume that reads its distributed checkpoint as data, verified first.

``ModelParallelStrategy.load_checkpoint`` reads a checkpoint folder itself, past any ``CheckpointIO`` plugin,
through ``torch.distributed.checkpoint``'s default planner, which unpickles every non-tensor item of the
shards (an optimizer's param-group settings) with ``weights_only=False``: a payload planted there runs.
:class:`VerifiedModelParallelStrategy` loads the same folder the same way, through
:func:`~.checkpoint_folders.load_sharded` (tensors and plain data only), after rank 0 has checked it against
its ``.sha256`` (:func:`~.checkpoint_folders.verify_folder`) and every rank has run the trainer's
``VerifiedCheckpointIO.inspect_on_load`` check (``ResumeGuard``: same run, shapes, callbacks) on it.

Example:
    >>> strategy = VerifiedModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
    ...                                          save_distributed_checkpoint=True)
    >>> L.Trainer(strategy=strategy, devices=2, plugins=[VerifiedCheckpointIO()]).fit(module, ckpt_path=folder)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from ...errors import CheckpointError
from .checkpoint_folders import load_sharded, read_folder
from .checkpoints import VerifiedCheckpointIO, verify_file
from .verified_files import trusted_by_environment


class VerifiedModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose ``load_checkpoint`` never runs code a checkpoint carries (see the module).

    Same arguments as ``ModelParallelStrategy``. Full unpickling only with ``VerifiedCheckpointIO(trust=True)``
    or ``PLASTICITY_TRUST_CHECKPOINTS=1``, as for file checkpoints; ``Trainer.fit(weights_only=...)`` is ignored.
    """

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))  # rank 0's path on every rank, as Lightning's does
        trust = self.trusted()
        problem = None
        if self.is_global_zero:  # one rank hashes the files; every rank gets the verdict (no rank left waiting)
            try:
                verify_file(path)
            except CheckpointError as err:
                problem = str(err)
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)
        if not path.is_dir():  # a whole-model file: Lightning's reader, with weights_only unless trusted
            return super().load_checkpoint(path, weights_only=not trust)
        checkpoint = read_folder(path, trust=trust, tensors=False)  # meta.pt, the index, the items as data
        inspect = getattr(self.checkpoint_io, "inspect_on_load", None)
        if inspect is not None:
            inspect(checkpoint, str(path))  # refused here, before any weight is loaded
        checkpoint.pop("state_dict")  # shapes only; the weights go straight into the shards below
        self.load_shards(path, trust)
        return checkpoint

    def load_shards(self, path: Path, trust: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_optimizer_state_dict)

        model_state = {"state_dict": get_model_state_dict(self.model)}
        load_sharded(model_state, path, trust)
        self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"  # as ModelParallelStrategy.save_checkpoint names them
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            load_sharded(optimizer_state, path, trust)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optimizer_state[key],
                                     options=StateDictOptions(cpu_offload=True))

    def trusted(self) -> bool:
        io = self.checkpoint_io
        if isinstance(io, VerifiedCheckpointIO) and io.trust is not None:
            return io.trust
        return trusted_by_environment()
