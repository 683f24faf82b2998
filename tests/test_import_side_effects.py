"""Importing the package changes nothing global: the user's matplotlib backend stays theirs."""
import subprocess
import sys

import pytest

CHECK = """
import matplotlib
matplotlib.use("svg")
import plasticity_callbacks.callbacks.figures
from plasticity_callbacks import AdaptiveSVDSwitch, DASHShrink, FIREReinit, ReDoMonitor, ShrinkPerturb
import plasticity_callbacks.app.report
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
"""


@pytest.mark.cli
def test_importing_callbacks_and_report_keeps_the_matplotlib_backend():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.cli
def test_figures_module_imports_no_matplotlib():
    code = "import sys, plasticity_callbacks.callbacks.figures; assert 'matplotlib' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
