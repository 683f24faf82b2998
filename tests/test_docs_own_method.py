"""docs/own_method.md as a new user follows it: its method (Parseval regularization) is three files, uses only
the page's ten concepts, and, written into a scratch copy of the repository with nothing else edited, is
exported and passes its own test and every cross-cutting test (bad arguments, damaged state, NaN weights,
FSDP2 refusal, the DDP table's config check)."""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from plasticity_callbacks.callbacks.base import PlasticityCallback
from plasticity_callbacks.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "own_method.md"
FENCE = re.compile(r"^(<!-- not run: (?P<why>[^>]+) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```$", re.M | re.S)
THREE = {"src/plasticity_callbacks/callbacks/parseval.py", "configs/callbacks/parseval.yaml", "tests/test_parseval.py"}


def named_files() -> dict[str, str]:
    """Every fenced block of the page whose first line is ``# <path>``: path -> text."""
    found = {}
    for m in FENCE.finditer(DOC.read_text()):
        first, _, _ = m["code"].partition("\n")
        if re.fullmatch(r"# [\w./-]+\.(py|yaml)", first):
            found[first[2:]] = m["code"]
    return found


@pytest.fixture(scope="module")
def doc():
    """The namespace the page's runnable Python blocks leave, run in order as one script."""
    code = [m["code"] for m in FENCE.finditer(DOC.read_text()) if m["lang"] == "python" and not m["why"]]
    assert len(code) == 2
    namespace: dict = {"__name__": "own_method_doc"}
    exec(compile("\n".join(code), str(DOC), "exec"), namespace)
    return SimpleNamespace(**namespace)


def concept_table() -> list[str]:
    """The first cell of each row of the page's concept table."""
    text = DOC.read_text()
    table = text[text.index("| concept |"):].split("\n\n")[0].splitlines()[2:]
    return [row.split("|")[1] for row in table]


def test_the_method_is_three_files():
    assert set(named_files()) == THREE


def test_the_method_uses_only_the_pages_ten_concepts():
    """Every name of the package that the method's files use (imports, class attributes it sets, base methods it
    calls on ``self``) is in the first column of the concept table (``Selection`` as ``selection``), which has at
    most ten rows."""
    rows = concept_table()
    assert len(rows) <= 10, rows
    listed = {name.lower() for span in re.findall(r"`([^`]+)`", " ".join(rows)) for name in re.findall(r"\w+", span)}
    base = set(dir(PlasticityCallback))
    used = set()
    for path, code in named_files().items():
        if not path.endswith(".py"):
            continue
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("plasticity_callbacks"):
                used.update(a.name for a in node.names if a.name != "Parseval")
            elif isinstance(node, ast.ClassDef):
                used.update(t.id for s in node.body if isinstance(s, ast.Assign) for t in s.targets)
                used.update(s.name for s in node.body if isinstance(s, ast.FunctionDef) and s.name in base)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                  and node.attr in base):
                used.add(node.attr)
    used -= {"__init__"}
    assert used and {name.lower() for name in used} <= listed, sorted(used)
    assert {"PlasticityCallback", "act", "check_number", "targets", "default_schedule"} <= used


def test_the_doc_method_refuses_bad_arguments_damaged_state_and_fsdp2_by_name(doc):
    for bad in (dict(beta=0.0), dict(beta=float("nan")), dict(scale=-1.0)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=.*must be a finite number"):
            doc.Parseval(**bad)
    with pytest.raises(CheckpointError, match=r"Parseval\.load_state_dict.*missing keys"):
        doc.Parseval().load_state_dict({"unrelated": 1})
    trainer = SimpleNamespace(strategy=type("ModelParallelStrategy", (), {})())
    with pytest.raises(MisconfigurationException, match="Parseval does not act on FSDP2's sharded weights.*FIREReinit"):
        doc.Parseval().check_strategy(trainer)


# What the scratch copy must run and pass for the new method: its own test and each cross-cutting test.
EXPECTED = {
    "test_parseval": 2,
    "test_bad_input": 7,  # beta and scale: Inf, NaN and a word each; a selection pattern that matches nothing
    "test_resume_safety": 3,  # wrong keys, a list, a string
    "test_non_finite": 1,  # a NaN weight in the step it acts (it reads no gradient)
    "test_fsdp": 1,  # FSDP2 refused, as it declares
    "test_ddp_all_callbacks": 1,  # its config puts it in the DDP runs
}


@pytest.mark.cli
def test_the_page_replayed_in_a_scratch_copy_passes_every_cross_cutting_test(tmp_path):
    scratch = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in ("src", "configs", "tests"):
        shutil.copytree(REPO / part, scratch / part, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", scratch / "pyproject.toml")
    for path, code in named_files().items():  # the three files, and no other edit
        assert not (scratch / path).exists(), path
        (scratch / path).write_text(code)
    env = {**os.environ, "PYTHONPATH": str(scratch / "src")}
    report = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         "-k", "parseval or accepted_by_the_callbacks or every_method_has_a_config",
         *(f"tests/{name}.py" for name in EXPECTED)],
        cwd=scratch, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    ran: dict[str, int] = {}
    for case in ET.parse(report).iter("testcase"):
        assert not list(case), ET.tostring(case, encoding="unicode")[:2000]  # no failure, error or skip
        module = case.get("classname").rsplit(".", 1)[-1]
        ran[module] = ran.get(module, 0) + 1
    assert ran == EXPECTED
    exported = subprocess.run([sys.executable, "-c", "import plasticity_callbacks as pc; print(pc.Parseval.__module__,"
                               " 'Parseval' in pc.__all__)"], cwd=scratch, env=env, capture_output=True, text=True)
    assert exported.stdout.split() == ["plasticity_callbacks.callbacks.parseval", "True"], exported.stderr[-2000:]
