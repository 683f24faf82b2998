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
import contextlib, io, json, os, sys, traceback
from plasticity_callbacks.app.train import main
results = []
home = os.getcwd()
for argv, cwd in json.loads(sys.argv[1]):
    os.chdir(cwd or home)
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
    results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
print("RESULTS" + json.dumps(results))
'''

# name: (overrides, words the explanation must contain, longest acceptable explanation in lines).
# Every case runs experiment=smoke (a single fit) unless it names another experiment.
CASES = {
    "misspelled_callback": (["+callbacks=fier"], ["callbacks=fier", "'fire'"], 1),
    "misspelled_group_option": (["model/mlp=swiglo"], ["model/mlp=swiglo", "'swiglu'"], 1),
    "misspelled_block": (["model.position=rop"], ["model.position='rop'", "rope"], 1),
    "misspelled_callback_argument": (["+callbacks=redo", "callbacks.redo.taux=0.1"], ["taux"], 1),
    "missing_required_field": (["data=files"], ["data.paths"], 2),
    "data_paths_match_nothing": (["data=files", "data.paths=/nonexistent/**/*.txt"], ["data.paths=", "no files"], 1),
    "type_error_in_callback": (["+callbacks=redo", "callbacks.redo.tau=abc"], ["tau='abc'", "[0, 1]"], 1),
    "type_error_in_dash": (["+callbacks=dash_periodic", "+callbacks.dash_periodic.cosine_threshold=abc"], ["cosine_threshold='abc'"], 1),
    "type_error_in_trainer": (["trainer.max_steps=abc"], ["trainer.max_steps='abc'", "integer"], 1),
    "seed_not_an_integer": (["seed=abc"], ["seed='abc'", "integer"], 1),
    "lr_not_a_number": (["optimizer.lr=abc"], ["optimizer.lr='abc'", "number"], 1),
    "lr_ignored_by_every_phase": (["experiment=pipeline_smoke", "optimizer.lr=0.01"],
                                  ["optimizer.lr=0.01", "phases.pretrain.optimizer.lr"], 1),
    "max_steps_ignored_by_a_pipeline": (["experiment=pipeline_smoke", "trainer.max_steps=10"],
                                        ["trainer.max_steps", "phases.<name>.steps"], 1),
    "run_dir_not_writable": (["hydra.run.dir=/sys/plasticity-train-check/run"], ["hydra.run.dir="], 1),
    "working_directory_not_writable": ([], ["hydra.run.dir="], 1),  # runs in /sys, no hydra.run.dir
}
NO_RUN_DIR = {"run_dir_not_writable", "working_directory_not_writable"}
READ_ONLY = "/sys"  # not writable even by root


def argv_of(name: str, tmp) -> list[str]:
    overrides = CASES[name][0]
    experiment = [] if any(o.startswith("experiment=") for o in overrides) else ["experiment=smoke"]
    run_dir = [] if name in NO_RUN_DIR else [f"hydra.run.dir={tmp}/{name}"]
    return [*experiment, *overrides, *run_dir]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hydra_errors")
    cases = [[argv_of(name, tmp), READ_ONLY if name == "working_directory_not_writable" else None] for name in CASES]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(cases)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "RESULTS" in proc.stdout, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS", 1)[1])
    return dict(zip(CASES, results))


@pytest.mark.cli
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
    if max_lines == 1:  # our own checks: exit status 2, and nothing was loaded or trained before
        assert code == 2 and "corpus:" not in outcomes[name]["stdout"], outcomes[name]["stdout"][-2000:]
