"""The README's bring-your-own-method example, as written there: a callback in the user's package and
one YAML in the user's config folder run in ``plasticity-train``'s task stream and ``plasticity-report``
with no edit to the package."""
import os
import re
from pathlib import Path

import pytest
import torch
from hydra_app import run_report, run_train

pytest.importorskip("sklearn")

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = ["data.num_tasks=3", "data.steps_per_task=6", "data.samples_per_task=128", "data.batch_size=32",
        "model.widths=[16,16]", "trainer.log_every_n_steps=3", "callbacks.task_metrics.probe_steps=2"]


def readme_files() -> dict[str, str]:
    """Every fenced block of the README whose first line is ``# <path>``: path -> text."""
    blocks = re.findall(r"```(?:python|yaml)\n# (\S+)\n(.*?)```", README.read_text(), flags=re.S)
    return {path: body for path, body in blocks if path.startswith(("my_methods/", "my_configs/"))}


@pytest.fixture()
def user_folder(tmp_path, monkeypatch):
    files = readme_files()
    assert set(files) == {"my_methods/__init__.py", "my_configs/method/scale.yaml"}
    for path, body in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.cli
def test_the_readme_method_runs_in_a_stream_and_its_report(user_folder):
    # the method names the user's own module: an opt-in (check_method_targets refuses it otherwise, next test)
    env = {"PYTHONPATH": os.pathsep.join([str(user_folder), os.environ.get("PYTHONPATH", "")]),
           "PLASTICITY_TRUST_CHECKPOINTS": "1"}
    sweep = user_folder / "sweep"
    proc = run_train("--config-dir", user_folder / "my_configs", "-m", "experiment=continual_digits", "+method=scale",
                     *TINY, f"hydra.sweep.dir={sweep}", cwd=user_folder, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = run_report(sweep, env=env)
    assert report.returncode == 0, report.stderr[-2000:]
    rows = [line for line in (sweep / "report" / "report.md").read_text().splitlines() if line.startswith("| ")]
    assert any("| scale | 1 |" in row for row in rows)


def test_the_readme_method_scales_the_weights_at_every_task_boundary(user_folder, monkeypatch):
    from hydra_app import compose_config

    from plasticity_callbacks.app.methods import method_names, task_stream_callbacks
    from plasticity_callbacks.app.pipeline import instantiate_callbacks, resolve_method
    from plasticity_callbacks.callbacks.schedule import Schedule
    from plasticity_callbacks.errors import ConfigError
    from plasticity_callbacks.models.classifier import DigitsClassifier

    configs = user_folder / "my_configs"
    assert "scale" in method_names([configs])
    cfg = compose_config(f"hydra.searchpath=[file://{configs}]", "experiment=continual_digits", "+method=scale")
    with pytest.raises(ConfigError, match=r"callbacks\.scale\._target_='my_methods.ScaleWeights' is not a class of "
                                          "plasticity_callbacks") as refused:
        resolve_method(cfg)  # the user's own module runs only with the opt-in
    assert "\n" not in str(refused.value) and "PLASTICITY_TRUST_CHECKPOINTS=1" in str(refused.value)
    monkeypatch.setenv("PLASTICITY_TRUST_CHECKPOINTS", "1")
    [callback] = instantiate_callbacks(task_stream_callbacks(resolve_method(cfg)))
    assert callback.firing.schedule == Schedule(at_task_boundaries=True)
    module = DigitsClassifier(widths=[8])
    before = [p.detach().clone() for p in module.parameters()]
    metrics = callback.act(None, module, "task 1 starts")
    assert metrics["scale/weight_norm"] == pytest.approx(float(torch.cat(
        [p.detach().flatten() for p in module.parameters() if p.ndim == 2]).norm()))
    for old, new in zip(before, module.parameters()):
        torch.testing.assert_close(new, old * 0.5 if old.ndim == 2 else old)


def test_the_pre_check_finds_the_users_config_group(user_folder):
    from plasticity_callbacks.app.config_checks import check_command_line
    from plasticity_callbacks.app.train import config_dir
    from plasticity_callbacks.errors import ConfigError

    configs = str(user_folder / "my_configs")
    check_command_line(["--config-dir", configs, "experiment=continual_digits", "+method=scale"], config_dir())
    check_command_line([f"hydra.searchpath=[file://{configs}]", "+method=scale"], config_dir())
    with pytest.raises(ConfigError, match="method=scal: no such option.*did you mean 'scale'"):
        check_command_line(["--config-dir", configs, "+method=scal"], config_dir())
    with pytest.raises(ConfigError, match="method=scale: no such option"):
        check_command_line(["+method=scale"], config_dir())  # without the user's folder
