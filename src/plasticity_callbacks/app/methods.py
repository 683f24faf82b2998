"""Plasticity methods, each declared once in ``configs/method/<name>.yaml`` and found there.

A method file says what happens at a boundary (between two phases of a pipeline, or between two
tasks of a task stream)::

    name: sp                 # the file's stem
    carry_optimizer: false   # false: the new phase / task starts with a fresh optimizer state
    callbacks:               # the callbacks that act at the boundary ({name: spec}, as configs/callbacks/)
      shrink_perturb: {_target_: plasticity_callbacks.ShrinkPerturb, shrink: 0.8, perturb: 0.2}
    task_stream:             # optional: what differs in a task stream, merged onto `callbacks`
      shrink_perturb: {reset_optimizer: true}
    sensitivity:             # the main hyperparameter and the values a sweep tries (the benchmark: every
      key: callbacks.shrink_perturb.shrink   #   method the same number of values, the file's own among them)
      values: [0.2, 0.4, 0.8]
    regime: "Designed for ...; here ..."     # one line: what it was designed for, where that does not apply
    ranked: false            # optional: not a row of the digits ranking (another regime; say why in regime)
    model:                   # optional: merged onto the run's ``model:``, for the whole run (every phase or
      norm: layer            #   task); the task streams' DigitsClassifier takes its norm and its Adam's
      weight_decay: 1.0e-3   #   lr and weight_decay here
    optimizer:               # optional: merged onto the run's ``optimizer:`` (the GPT pipeline's)
      weight_decay: 0.1

A ``model:`` or ``optimizer:`` block makes the method a setting of the whole run, not only an action at its
boundaries (:func:`with_method_settings`): ``l2`` is Adam's weight decay, ``ln_wd`` a layer norm and weight
decay. A key the run's config does not have is refused, naming the keys it has.

Everything that runs methods reads this file: the pipeline (phases), the task streams
(:func:`task_stream_callbacks`), the benchmarks (:func:`method_names`, :func:`sensitivity`) and the
reports. A user's method is one more file in a folder of their own on the config search path
(``--config-dir`` / ``hydra.searchpath``).

Example:
    >>> method_names()
    ['cbp', 'dash', 'fire_continual', 'fire_exact', 'fire_exact_head', 'fire_lm', 'hare_tortoise', ...]
    >>> task_stream_callbacks(compose_method("sp"))  # the specs that act at every task boundary
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from .config_checks import config_dir

METHOD_KEYS = {"name", "callbacks", "carry_optimizer", "task_stream", "sensitivity", "model", "optimizer", "regime",
               "ranked"}
# What a method file says about itself, not a setting of the run: a run's fingerprint leaves them out.
DESCRIPTION_KEYS = ("name", "regime", "ranked", "sensitivity")
# The schedule of a callback that acts "at the boundary" of a pipeline phase; in a task stream that
# boundary is every task boundary.
AT_TASK_BOUNDARIES = {"_target_": "plasticity_callbacks.callbacks.schedule.Schedule", "at_task_boundaries": True}
# Keeps the weights and drops the optimizer's state: a fresh optimizer, inside one Trainer.
FRESH_OPTIMIZER_STATE = {"_target_": "plasticity_callbacks.ShrinkPerturb", "shrink": 1.0, "perturb": 0.0,
                         "reset_optimizer": True, "schedule": AT_TASK_BOUNDARIES}


def method_names(config_dirs: Iterable[str | Path] = ()) -> list[str]:
    """Every method declared as ``method/<name>.yaml`` in the package's configs and in ``config_dirs``.

    Args:
        config_dirs: further config folders (a user's ``--config-dir``), searched after the package's.
    """
    names = set()
    for folder in (config_dir(), *config_dirs):
        names.update(p.stem for p in (Path(folder) / "method").glob("*.yaml"))
    return sorted(names)


PACKAGE_PREFIX = "plasticity_callbacks."


def method_file(name: str | None, config_dirs: Iterable[str | Path] = ()) -> Path:
    """The file ``method/<name>.yaml`` a composed method came from: a user's folder first (Hydra's search path
    puts it before the package's), else the package's."""
    for folder in (*config_dirs, config_dir()):
        path = Path(folder).expanduser() / "method" / f"{name}.yaml"
        if path.is_file():
            return path
    return Path(config_dir()) / "method" / f"{name}.yaml"


def check_method_targets(method: DictConfig, config_dirs: Iterable[str | Path] = ()) -> None:
    """Every ``_target_`` of a method file must be a class of this package, before anything is imported: a method
    file from a ``--config-dir`` is data, and ``_target_: os.system`` (or a module of its own, which imports and
    runs) would be code. The opt-in is the checkpoints' switch, ``PLASTICITY_TRUST_CHECKPOINTS=1``.

    Raises:
        ConfigError: one line naming the file, the key and the target.

    Example:
        >>> check_method_targets(compose_method("sp"))   # the package's own method files pass
    """
    from .runs.verified_files import TRUST_ENV, trusted_by_environment

    if trusted_by_environment():
        return
    for key, target in _targets(OmegaConf.to_container(method, resolve=False), ""):
        if not isinstance(target, str) or not target.startswith(PACKAGE_PREFIX):
            raise ConfigError(f"{method_file(method.get('name'), config_dirs)}: {key}={target!r} is not a class of "
                              f"plasticity_callbacks; a method file may instantiate only this package's classes (set "
                              f"{TRUST_ENV}=1 to run one you trust)")


def user_config_dirs() -> list[Path]:
    """The config folders on Hydra's search path besides the package's (``--config-dir``, ``hydra.searchpath``),
    inside a ``plasticity-train`` run; none elsewhere."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    package = Path(config_dir()).resolve()
    return [Path(source.path) for source in HydraConfig.get().runtime.config_sources
            if source.schema == "file" and Path(source.path).resolve() != package]


def _targets(node, prefix: str):
    """``(dotted key, value)`` of every ``_target_`` inside ``node`` (dicts and lists, at any depth)."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{prefix}.{key}" if prefix else str(key)
            if key == "_target_":
                yield where, value
            else:
                yield from _targets(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _targets(value, f"{prefix}[{index}]")


def check_method(method: DictConfig) -> None:
    """A method block has only the known keys (one line naming the others)."""
    unknown = set(method) - METHOD_KEYS
    if unknown:
        raise ConfigError(f"method {method.get('name')!r} has unknown keys {sorted(unknown)}; "
                          f"allowed: {sorted(METHOD_KEYS)}")


def at_phase_boundary(schedule) -> bool:
    """Whether ``schedule`` is the "once at fit start" one (null means that for every method callback)."""
    if schedule is None:
        return True
    fields = {k: v for k, v in dict(schedule).items() if k != "_target_"}
    return fields == {"at_fit_start": True}


def takes_schedule(spec) -> bool:
    """Whether the spec's ``_target_`` accepts ``schedule=`` (a method acting at every step may not)."""
    import inspect

    from hydra.utils import get_object

    target = spec.get("_target_")
    return target is not None and "schedule" in inspect.signature(get_object(target)).parameters


def task_stream_callbacks(method: DictConfig) -> DictConfig:
    """The method's callbacks as they act in a task stream (one Trainer for every task).

    A callback scheduled at the phase boundary (``at_fit_start``) acts at every task boundary
    instead; other schedules (ReDo's every 100 steps) are kept. The method's ``task_stream``
    block is merged on top. With ``carry_optimizer: false`` the optimizer's state is dropped at
    every task boundary, as a new phase's fresh optimizer would be.

    Args:
        method: the composed method block (``cfg.method``).

    Returns:
        ``{name: spec}``: callback specs for :func:`~app.pipeline.instantiate_callbacks`.
    """
    check_method(method)
    declared = method.get("callbacks")
    callbacks = OmegaConf.create(OmegaConf.to_container(declared, resolve=True) if declared else {})
    for name, spec in callbacks.items():
        if spec is not None and takes_schedule(spec) and at_phase_boundary(spec.get("schedule")):
            spec.schedule = dict(AT_TASK_BOUNDARIES)
    extra = method.get("task_stream") or {}
    unknown = set(extra) - set(callbacks)
    if unknown:
        raise ConfigError(f"method {method.get('name')!r}: task_stream names {sorted(unknown)}, which are not among "
                          f"its callbacks {sorted(callbacks)}")
    callbacks = OmegaConf.merge(callbacks, extra)
    if not method.get("carry_optimizer", True):  # first: a fresh draw after FullReset's would equal its weights
        callbacks = OmegaConf.merge({"fresh_optimizer_state": FRESH_OPTIMIZER_STATE}, callbacks)
    return callbacks


def with_method_settings(cfg: DictConfig, method: DictConfig) -> DictConfig:
    """``cfg`` with the method's ``model:`` and ``optimizer:`` blocks merged onto ``cfg.model`` and ``cfg.optimizer``.

    A model given by ``_target_`` (the task streams' ``DigitsClassifier``) builds its own optimizer from its
    own arguments (``lr``, ``weight_decay``), so a method sets those under ``model:``; ``optimizer:`` is for the
    GPT, whose optimizer ``cfg.optimizer`` configures.

    Args:
        cfg: the composed run config (not changed).
        method: its method block (:func:`~app.pipeline.resolve_method`).

    Returns:
        A copy of ``cfg``; ``cfg`` itself when the method sets neither.

    Raises:
        ConfigError: a key the run's ``model``/``optimizer`` config does not have, or ``optimizer:`` for a model
            that builds its own optimizer.

    Example:
        >>> cfg = with_method_settings(cfg, compose_method("ln_wd"))   # cfg.model.norm == "layer"
    """
    check_method(method)
    blocks = {group: method.get(group) for group in ("model", "optimizer") if method.get(group)}
    if not blocks:
        return cfg
    name = method.get("name")
    if "optimizer" in blocks and "_target_" in cfg.model:
        raise ConfigError(f"method {name!r} sets optimizer: {OmegaConf.to_container(blocks['optimizer'])}, but the "
                          f"model ({cfg.model._target_}) builds its own optimizer from its own arguments: set "
                          f"them under model: (e.g. model: {{weight_decay: 1.0e-3}})")
    for group, block in blocks.items():
        unknown = sorted(set(block) - set(cfg.get(group) or {}))
        if unknown:
            raise ConfigError(f"method {name!r} sets {group}.{unknown[0]}, which the run's {group} config does not "
                              f"have; its keys: {sorted(cfg.get(group) or {})}")
    return OmegaConf.merge(cfg, {group: OmegaConf.to_container(block) for group, block in blocks.items()})


def sensitivity(method: DictConfig) -> tuple[str, list] | None:
    """The method's main hyperparameter, as ``(override key under method., values)``, or None."""
    block = method.get("sensitivity")
    if block is None:
        return None
    key, values = block.get("key"), block.get("values")
    # a run setting (model.lr) may be swept without the file setting it: the run's own value is its default
    run_setting = str(key or "").startswith(("model.", "optimizer."))
    if not key or not values or (OmegaConf.select(method, key) is None and not run_setting):
        raise ConfigError(f"method {method.get('name')!r}: sensitivity needs key (a setting of the method, "
                          f"e.g. callbacks.sp.shrink, or of the run, e.g. model.lr) and values; got key={key!r}, "
                          f"values={values!r}")
    return str(key), list(values)
