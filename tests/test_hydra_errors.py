"""A wrong Hydra config is explained in a line or two, never with a traceback into Hydra's internals.

All cases run the real entry point (``plasticity_callbacks.app.train.main``, what ``plasticity-train``
calls) with their own ``sys.argv``, in one subprocess to pay the imports once; each case stops at
composition or instantiation, before any training. (test_cli.py runs the installed console script.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

DRIVER = r'''
import contextlib, io, json, sys, traceback
from plasticity_callbacks.app.train import main
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["plasticity-train", *argv]
    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:
            code = "uncaught"
            traceback.print_exc(file=err)
    results.append({"code": code, "stderr": err.getvalue()})
print("RESULTS" + json.dumps(results))
'''

# name: (overrides, words the explanation must contain, longest acceptable explanation in lines)
CASES = {
    "misspelled_callback": (["+callbacks=fier"], ["callbacks/fier", "fire"], 20),  # Hydra lists the options
    "misspelled_block": (["model.position=rop"], ["model.position='rop'", "rope"], 1),
    "misspelled_callback_argument": (["+callbacks=redo", "callbacks.redo.taux=0.1"], ["taux"], 8),
    "missing_required_field": (["data=files"], ["data.paths"], 2),
    "type_error_in_callback": (["+callbacks=redo", "callbacks.redo.tau=abc"], ["tau='abc'", "[0, 1]"], 1),
    "type_error_in_dash": (["+callbacks=dash", "+callbacks.dash.alpha=abc"], ["alpha='abc'"], 1),
    "type_error_in_trainer": (["trainer.max_steps=abc"], ["Trainer"], 1),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hydra_errors")
    argvs = [["experiment=smoke", *overrides, f"hydra.run.dir={tmp}/{name}"] for name, (overrides, _, _) in CASES.items()]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "RESULTS" in proc.stdout, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    return dict(zip(CASES, results))


@pytest.mark.parametrize("name", list(CASES))
def test_config_mistake_is_explained_without_a_traceback(outcomes, name):
    _, words, max_lines = CASES[name]
    code, stderr = outcomes[name]["code"], outcomes[name]["stderr"]
    assert code not in (0, "uncaught"), stderr[-2000:]
    assert "Traceback" not in stderr and "_instantiate2.py" not in stderr, stderr[-2000:]
    explanation = [line for line in stderr.splitlines()
                   if line.strip() and not line.startswith(("Seed set", "Set the environment variable HYDRA_FULL"))]
    assert len(explanation) <= max_lines, "\n".join(explanation)
    for word in words:
        assert word in stderr, stderr[-2000:]
