"""Every callback is declared once (configs/callbacks/<name>.yaml); methods and experiments compose it
through ``defaults:`` and override only what differs; everything instantiates with the code's defaults."""
from pathlib import Path

import pytest
from hydra.utils import instantiate
from hydra_app import compose_config
from omegaconf import OmegaConf

from plasticity_callbacks.app.train import config_dir
from plasticity_callbacks.callbacks.schedule import Schedule
from plasticity_callbacks.functional.isometry import FIREOptions

CONFIGS = Path(config_dir())
CALLBACKS = sorted(p.stem for p in (CONFIGS / "callbacks").glob("*.yaml"))
METHODS = sorted(p.stem for p in (CONFIGS / "method").glob("*.yaml"))


@pytest.mark.parametrize("name", CALLBACKS)
def test_each_callback_config_instantiates_alone(name):
    cfg = compose_config("~experiment", f"+callbacks={name}")
    (spec,) = cfg.callbacks.values()
    callback = instantiate(spec, _convert_="all")
    assert type(callback).__name__ == spec._target_.rsplit(".", 1)[-1]


@pytest.mark.parametrize("name", METHODS)
def test_each_method_instantiates_its_callbacks(name):
    method = compose_config(f"+method={name}").method
    for spec in (method.callbacks or {}).values():
        instantiate(spec)  # raises on any argument the callback no longer takes


def test_methods_override_only_what_differs():
    fire = instantiate(compose_config("+method=fire_lm").method.callbacks.fire)
    assert fire.options == FIREOptions(method="newton_schulz", normalize="frobenius", steps=5)
    assert fire.schedule == Schedule(at_fit_start=True) and fire.save_spectra
    exact = instantiate(compose_config("+method=fire_exact").method.callbacks.fire)
    assert exact.options == FIREOptions(method="svd")
    redo = instantiate(compose_config("+method=redo").method.callbacks.redo)
    assert redo.schedule == Schedule(every_n_steps=100) and redo.log_every_n_steps == 50 and redo.tau == 0.025


def differing_keys(a, b, prefix=""):
    """The dotted keys at which two nested mappings differ."""
    keys = set(a) | set(b)
    out = set()
    for key in keys:
        x, y = a.get(key), b.get(key)
        if isinstance(x, dict) and isinstance(y, dict):
            out |= differing_keys(x, y, f"{prefix}{key}.")
        elif x != y:
            out.add(f"{prefix}{key}")
    return out


def method_block(name):
    block = OmegaConf.to_container(compose_config(f"+method={name}").method, resolve=True)
    for key in ("name", "sensitivity", "regime", "ranked"):  # what the file says about itself, not a setting
        block.pop(key, None)
    # a model setting equal to the task streams' model default (warm's lr, named for its sweep) changes nothing
    default = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "digits_mlp.yaml"))
    model = {k: v for k, v in (block.pop("model", None) or {}).items() if default.get(k) != v}
    return {**block, **({"model": model} if model else {})}


@pytest.mark.parametrize("method, neighbour, difference", [
    ("fire_lm", "fire_continual", {"callbacks.fire.options.steps"}),
    ("fire_exact", "fire_exact_head", {"callbacks.fire.selection.include_head"}),
    ("fire_exact_head", "fire_continual", {"callbacks.fire.options.method", "callbacks.fire.options.normalize",
                                           "callbacks.fire.options.steps", "callbacks.fire.options.dtype"}),
    ("isometric_reset", "fire_exact", {"callbacks.full_reset"}),
    ("warm_reset", "warm", {"carry_optimizer"}),
    ("head_reset", "warm", {"callbacks.full_reset"}),
    ("l2", "warm", {"model"}),
    ("ln_wd", "l2", {"model.norm"}),
])
def test_each_method_differs_from_its_neighbour_in_one_setting(method, neighbour, difference):
    """The solver (method/normalize/steps/dtype of the options) counts as one setting."""
    assert differing_keys(method_block(method), method_block(neighbour)) == difference


@pytest.mark.parametrize("name", [m for m in METHODS if "/callbacks/fire@callbacks" in (CONFIGS / "method" / f"{m}.yaml").read_text()])
def test_every_fire_method_file_states_its_head_treatment(name):
    fire = OmegaConf.load(CONFIGS / "method" / f"{name}.yaml").callbacks.fire
    assert isinstance(fire.selection.include_head, bool), name


def test_no_callback_target_is_restated_outside_configs_callbacks():
    declared = {f"_target_: {line.split(':', 1)[1].strip()}" for name in CALLBACKS
                for line in (CONFIGS / "callbacks" / f"{name}.yaml").read_text().splitlines()
                if line.strip().startswith("_target_: plasticity_callbacks.") and "Schedule" not in line
                and "FIREOptions" not in line}
    for path in [*CONFIGS.glob("method/*.yaml"), *CONFIGS.glob("experiment/*.yaml")]:
        text = path.read_text()
        assert not any(target in text for target in declared), f"{path.name} restates a callback's _target_"


def test_an_added_callback_and_the_experiments_redo_coexist():
    cfg = compose_config("+callbacks=fire")  # the default experiment composes callbacks/redo too
    assert set(cfg.callbacks) == {"redo", "fire"}
