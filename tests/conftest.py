import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tiny.py, ddp_harness.py

# Two cores: one intra-op thread per test process keeps timings stable and leaves room for DDP ranks.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
