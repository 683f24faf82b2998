"""docs/own_method.md: its Python runs as written, and the method it builds passes the checks every method
gets (an exact effect, garbage state refused, FSDP2 refused by default with the fix)."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from plasticity_callbacks.errors import CheckpointError
from plasticity_callbacks.model_map import fresh_parameters

DOC = Path(__file__).resolve().parents[1] / "docs" / "own_method.md"


@pytest.fixture(scope="module")
def doc():
    """The namespace the doc's Python blocks leave, run in order as one script."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 2
    namespace: dict = {"__name__": "own_method_doc"}
    exec(compile("\n".join(blocks), str(DOC), "exec"), namespace)
    return SimpleNamespace(**namespace)


def test_the_head_is_a_fresh_draw_of_the_models_own_init_at_each_boundary_and_nothing_else_moves(doc):
    model, reset = doc.Classifier(), doc.HeadReset(schedule=doc.Schedule(steps=[0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.training_step((torch.randn(8, 8), torch.randint(0, 3, (8,))), 0).backward()
    optimizer.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = SimpleNamespace(global_step=0, optimizers=[optimizer])
    assert reset.act(trainer, model, "step 0") == {"head_reset/resets": 1}
    fresh = fresh_parameters(model, seed=0)  # the model map's draw for the same seed, independently
    for name, param in model.named_parameters():
        if name in ("net.2.weight", "net.2.bias"):
            assert torch.equal(param, fresh[name]) and not torch.equal(param, before[name])
            assert param not in optimizer.state
        else:
            assert torch.equal(param, before[name]) and param in optimizer.state


def test_the_doc_method_refuses_damaged_state_and_fsdp2_like_every_method(doc):
    with pytest.raises(CheckpointError, match=r"HeadReset\.load_state_dict.*missing keys"):
        doc.HeadReset().load_state_dict({"unrelated": 1})
    trainer = SimpleNamespace(strategy=type("ModelParallelStrategy", (), {})())
    with pytest.raises(MisconfigurationException,
                       match="HeadReset does not act on FSDP2's sharded weights.*FIREReinit"):
        doc.HeadReset().check_strategy(trainer)
