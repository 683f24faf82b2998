"""Configuration mistakes found before any work starts: one line that names the field and the fix.

Two moments:

- :func:`check_command_line` runs before Hydra starts the job: a misspelled config group option
  (``+callbacks=fier``, ``model/mlp=swiglo``) or key (``callbacks.redo.taux=0.1``) and a run
  directory that cannot be written (a read-only working directory) are one line each instead of
  Hydra's block or traceback.
- :func:`check_config` runs on the composed config, before any data is read: value types
  (``seed=abc``, ``optimizer.lr=abc``), file globs that match nothing (``data.paths``) and
  command-line settings that the run would ignore (``optimizer.lr=...`` when every phase sets
  its own ``lr``).

Both raise :class:`ConfigError`; ``plasticity-train`` prints its message as one line and exits 2.

Example:
    >>> check_command_line(["+callbacks=fier"], config_dir())
    Traceback (most recent call last):
    ConfigError: callbacks=fier: no such option; choose from adaptive_svd, dash, fire, ... (did you mean 'fire'?)
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import tempfile
from pathlib import Path
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from ..models.optimizers import OptimizerSettings
from ..errors import ConfigError

log = logging.getLogger(__name__)

# Where Hydra writes a run when the command line does not say (hydra/conf's defaults).
DEFAULT_RUN_ROOT = {False: "outputs", True: "multirun"}
# Arguments that only print (Hydra's --help, --cfg job, ...): nothing is written, nothing to check.
PRINT_ONLY_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


# ------------------------------------------------------------------------------ the command line

def config_dir() -> str:
    """The ``configs/`` folder: inside the installed wheel, or at the top of a source checkout."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "configs", package.parents[1] / "configs"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no Hydra configs found next to {package}; reinstall the package")


def check_command_line(argv: list[str], config_dir: str) -> None:
    """Check the group options and the run directory named on the command line (``sys.argv[1:]``).

    Args:
        argv: the arguments after the program name, as Hydra will read them.
        config_dir: the primary config folder (``configs/``).

    Raises:
        ConfigError: a group option that has no ``<group>/<option>.yaml``, a key the composed
            config does not have, or a run directory that cannot be created.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if any(arg in PRINT_ONLY_FLAGS or arg.startswith(("--cfg=", "--info=")) for arg in argv):
        return
    try:
        args, _ = get_args_parser().parse_known_args(argv)  # what it cannot parse, Hydra reports itself
        overrides = OverridesParser.create().parse_overrides(args.overrides)
    except (Exception, SystemExit):  # a syntax error: Hydra's own message says where it is
        return
    roots = search_roots(config_dir, args.config_dir, overrides)
    for override in overrides:
        group = override.key_or_group
        folders = [root / group for root in roots if (root / group).is_dir()]
        if override.is_delete() or group.startswith("hydra") or not folders:
            continue
        for option in option_values(override):
            if not any((folder / f"{option}.yaml").is_file() for folder in folders):
                raise ConfigError(unknown_option_message(folders, group, option))
    check_composition(args, overrides, config_dir)
    run_dir_key = "hydra.sweep.dir" if args.multirun else "hydra.run.dir"
    given = {o.key_or_group: o.value() for o in overrides if not o.is_sweep_override()}
    check_writable(str(given.get(run_dir_key, DEFAULT_RUN_ROOT[bool(args.multirun)])), run_dir_key)


def check_composition(args, overrides: list, config_dir: str) -> None:
    """Compose once as Hydra will (a sweep: its first values), so that a key the config does not
    have (``callbacks.redo.taux=0.1``) is one line, not Hydra's block."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if args.config_path or GlobalHydra.instance().is_initialized():
        return  # another primary config folder, or inside a running Hydra app: let Hydra compose
    first_values = []
    if args.config_dir:  # searched after the package's configs, as Hydra searches it
        if any(o.key_or_group == "hydra.searchpath" for o in overrides):
            return  # both: let Hydra compose
        first_values.append(f"hydra.searchpath=[file://{Path(args.config_dir).expanduser().absolute()}]")
    for override in overrides:
        if override.is_sweep_override():
            values = option_values(override)
            if not values:
                return  # a range or interval sweep: nothing simple to stand in for it
            first_values.append(f"{override.input_line.split('=', 1)[0]}={values[0]}")
        else:
            first_values.append(override.input_line)
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(args.config_name or "config", overrides=first_values)
    except (HydraException, OmegaConfBaseException) as err:
        lines = [line.strip() for line in str(err).splitlines()
                 if line.strip() and not line.strip().startswith(("full_key:", "object_type="))]
        raise ConfigError(" ".join(lines)) from None


def option_values(override) -> Iterable[str]:
    """The option names an override selects: one, a list (``+callbacks=[fire,redo]``) or a sweep."""
    if override.is_sweep_override():
        try:
            return [str(v) for v in override.sweep_string_iterator()]
        except Exception:  # a range or interval sweep: not option names
            return []
    value = override.value()
    return [str(v) for v in value] if isinstance(value, list) else [str(value)] if value is not None else []


def search_roots(config_dir: str, user_config_dir: str | None, overrides: list) -> list[Path]:
    """The config folders Hydra will search: the package's, ``--config-dir``, and the ``file://``
    entries of ``hydra.searchpath=[...]`` (a ``pkg://`` entry is resolved through its package)."""
    roots = [Path(config_dir)]
    if user_config_dir:
        roots.append(Path(user_config_dir).expanduser().absolute())
    for override in overrides:
        if override.key_or_group != "hydra.searchpath" or override.is_sweep_override():
            continue
        value = override.value()
        for entry in value if isinstance(value, list) else [value]:
            roots.extend(filter(None, [search_path_folder(str(entry))]))
    return roots


def search_path_folder(entry: str) -> Path | None:
    """The folder of one ``hydra.searchpath`` entry, or None where it names none that exists."""
    if entry.startswith("pkg://"):
        import importlib.util

        package, _, below = entry.removeprefix("pkg://").partition("/")
        spec = importlib.util.find_spec(package) if package else None
        if spec is None or not spec.submodule_search_locations:
            return None
        folder = Path(list(spec.submodule_search_locations)[0], below)
    else:
        folder = Path(entry.removeprefix("file://")).expanduser().absolute()
    return folder if folder.is_dir() else None


def unknown_option_message(folders: Path | list[Path], group: str, option: str) -> str:
    folders = [folders] if isinstance(folders, Path) else folders
    choices = sorted({p.stem for folder in folders for p in folder.glob("*.yaml")})
    close = difflib.get_close_matches(option, choices, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{group}={option}: no such option; choose from {', '.join(choices)}{hint}"


def check_writable(run_dir: str, key: str) -> None:
    """The run directory (its fixed part, before any ``${...}``) can be created: try it in the
    nearest folder that exists (``os.access`` says yes to root on read-only mounts)."""
    fixed = Path(run_dir.split("${", 1)[0] or ".").expanduser().absolute()
    existing = next(p for p in (fixed, *fixed.parents) if p.exists())
    try:
        if existing.is_dir():
            Path(tempfile.mkdtemp(prefix=".plasticity-write-check-", dir=existing)).rmdir()
        else:
            raise NotADirectoryError(f"{existing} is a file")
    except OSError as err:
        reason = err.strerror or str(err)
        raise ConfigError(f"cannot create the run directory {run_dir!r} under {existing} ({reason}); "
                          f"set {key}=<a writable folder>") from None


# ------------------------------------------------------------------------------ the composed config

def check_config(cfg: DictConfig, overrides: Iterable[str] = ()) -> None:
    """Check a composed config before any data is read or any model is built.

    Args:
        cfg: the composed config (``plasticity-train``'s).
        overrides: the command-line overrides (``HydraConfig.get().overrides.task``), to find
            settings the run would ignore.

    Raises:
        ConfigError: the first mistake, as one line naming the field.
    """
    seed = cfg.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed={seed!r} must be an integer")
    check_trainer_counts(cfg.get("trainer"))
    check_optimizer("optimizer", cfg.get("optimizer"))
    for name, block in (cfg.get("phases") or {}).items():
        if block and block.get("optimizer"):
            check_optimizer(f"phases.{name}.optimizer", OmegaConf.merge(cfg.optimizer, block.optimizer),
                            only=set(block.optimizer))
    check_fsdp2(cfg)
    check_data_paths("data", cfg.get("data"))
    for name, block in (cfg.get("phases") or {}).items():
        if block and block.get("data") and block.data.get("paths") is not None:
            check_data_paths(f"phases.{name}.data", block.data)
    if cfg.get("phases"):
        check_ignored_overrides(cfg, overrides)
    elif cfg.get("method") is not None and not cfg.get("method_at_task_boundaries"):
        # A method acts at phase or task boundaries; a single fit has neither, so it would be ignored.
        raise ConfigError(f"+method={cfg.method.get('name', '?')} has no effect in a single fit (no phase or task "
                          "boundary): run a pipeline (experiment=pretrain_sft, pipeline_smoke, continual_pretrain) or "
                          "a task stream (experiment=continual_digits), or add callbacks to this fit with +callbacks=<name>")


def check_fsdp2(cfg: DictConfig) -> None:
    """FSDP2 (``trainer=fsdp2``, Lightning's ``ModelParallelStrategy``): every rank holds a data-parallel shard,
    so ``data_parallel_size`` must be the rank count ``trainer.devices × trainer.num_nodes`` and
    ``tensor_parallel_size`` 1 (Lightning would only find a mismatch after starting every process). Either
    kind of checkpoint works in a pipeline: a phase hands its ``final.ckpt`` (file or verified folder of
    shards) to the next."""
    trainer = cfg.get("trainer")
    strategy = trainer.get("strategy") if trainer is not None else None
    if not isinstance(strategy, DictConfig) or not str(strategy.get("_target_", "")).endswith("ModelParallelStrategy"):
        return
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    count = len(devices) if OmegaConf.is_list(devices) else devices
    if isinstance(count, bool) or not isinstance(count, int) or count < 1 or not isinstance(nodes, int):
        raise ConfigError(f"trainer.devices={devices!r}: FSDP2 (ModelParallelStrategy) needs a number of devices, "
                          "from which its data_parallel_size (the rank count) follows; set e.g. trainer.devices=8")
    ranks = count * nodes
    tensor_parallel = strategy.get("tensor_parallel_size")
    if tensor_parallel != 1:
        raise ConfigError(f"trainer.strategy.tensor_parallel_size={tensor_parallel!r}: the models shard on the "
                          "data-parallel mesh only (fully_shard); set trainer.strategy.tensor_parallel_size=1")
    if strategy.get("data_parallel_size") != ranks:
        raise ConfigError(f"trainer.strategy.data_parallel_size={strategy.get('data_parallel_size')!r} is not the rank "
                          f"count trainer.devices × trainer.num_nodes = {count} × {nodes} = {ranks}; set "
                          f"trainer.strategy.data_parallel_size={ranks}")


# Trainer settings a typo turns into a TypeError deep inside Lightning: (key, smallest value, example).
TRAINER_COUNTS = (("max_steps", -1, 300), ("max_epochs", -1, 10), ("log_every_n_steps", 0, 10),
                  ("accumulate_grad_batches", 1, 4), ("devices", 1, 2), ("num_nodes", 1, 1),
                  ("num_sanity_val_steps", -1, 0))


def check_trainer_counts(trainer: DictConfig | None) -> None:
    """The trainer's counts are integers in range (``trainer.max_steps=abc`` names the key and an example)."""
    for key, low, example in TRAINER_COUNTS:
        value = (trainer or {}).get(key)
        if value is None or (key == "devices" and value == "auto"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"trainer.{key}={value!r} must be an integer >= {low}, e.g. trainer.{key}={example}")


def optimizer_arguments() -> dict[str, Any]:
    """``{setting: default}`` of every optimizer setting but ``name`` (:class:`OptimizerSettings`'s fields)."""
    return {f.name: f.default for f in dataclasses.fields(OptimizerSettings) if f.name != "name"}


def check_optimizer(prefix: str, block: DictConfig | None, only: set[str] | None = None) -> None:
    """Every optimizer setting is a field of :class:`OptimizerSettings`, of its default's type."""
    if block is None:
        return
    allowed = optimizer_arguments()
    values = OmegaConf.to_container(block, resolve=True)
    for key, value in values.items():
        if key == "name" or (only is not None and key not in only):
            continue
        if key not in allowed:
            raise ConfigError(f"{prefix}.{key} is not an optimizer setting; choose from name, {', '.join(allowed)}")
        default = allowed[key]
        if not same_kind(value, default):
            raise ConfigError(f"{prefix}.{key}={value!r} must be {kind_name(default)}")
        numbers = value if isinstance(value, (tuple, list)) else [value]
        if isinstance(default, (int, float, tuple, list)) and not isinstance(default, bool) and any(
                not math.isfinite(v) or v < 0 for v in numbers):
            raise ConfigError(f"{prefix}.{key}={value!r} must be finite and >= 0, e.g. {prefix}.{key}={default!r}")


def same_kind(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(default) and all(
            same_kind(v, d) for v, d in zip(value, default))
    if isinstance(default, str):
        return isinstance(value, str)
    return True


def kind_name(default: Any) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, (tuple, list)):
        return f"a list of {len(default)} numbers, e.g. {list(default)}"
    return "a string"


def check_data_paths(prefix: str, data: DictConfig | None) -> None:
    """``source: files`` corpora: the glob matches files now, not after the model is built."""
    if data is None or data.get("source") != "files" or OmegaConf.is_missing(data, "paths"):
        return
    from ..data.corpus import glob_files

    paths = OmegaConf.to_container(data, resolve=True)["paths"]
    if not paths or not glob_files(paths):
        raise ConfigError(f"{prefix}.paths={paths!r} matches no files (a glob such as '~/corpus/**/*.txt')")


# Top-level blocks that a phase's own block is merged onto: a key every phase sets is ignored.
PHASE_MERGED = ("optimizer", "trainer", "data")


def check_ignored_overrides(cfg: DictConfig, overrides: Iterable[str]) -> None:
    """A command-line setting that no phase uses is refused; one that some phases do not use is warned about."""
    phases = dict(cfg.phases)
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if override.startswith("~") or "." not in key:
            continue
        group, rest = key.split(".", 1)
        if key == "trainer.max_steps":
            raise ConfigError(f"{override} has no effect in a multi-phase run: each phase runs "
                              f"phases.<name>.steps steps (phases: {', '.join(phases)})")
        if group not in PHASE_MERGED:
            continue
        reasons = [why for name, block in phases.items() if (why := ignored_by(cfg, name, block, group, rest))]
        if len(reasons) == len(phases):
            raise ConfigError(f"{key}={value} has no effect: every phase sets its own ({', '.join(reasons)}); "
                              "override those instead")
        if reasons:
            log.warning(f"{key}={value} is not used where {', '.join(reasons)}")


def ignored_by(cfg: DictConfig, phase: str, block: DictConfig | None, group: str, dotted: str) -> str | None:
    """Why phase ``phase`` does not use the top-level ``<group>.<dotted>``, or None when it does."""
    own = (block or {}).get(group)
    if not own:
        return None
    raw = OmegaConf.to_container(own, resolve=False)
    for part in dotted.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    if raw == f"${{{group}.{dotted}}}":
        return None  # the phase reads the top-level value
    if raw is not None:
        return f"phases.{phase}.{group}.{dotted}={OmegaConf.select(own, dotted)}"
    if group == "data" and own.get("_target_", cfg.data.get("_target_")) != cfg.data.get("_target_"):
        return f"phases.{phase}.data has its own _target_"  # it replaces the top-level data block
    return None
