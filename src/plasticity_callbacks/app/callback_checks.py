"""Callback and task-stream settings checked on the composed config, before any data is read.

- Every key of a callback spec (``callbacks.*``, ``phases.*.callbacks``, ``method.callbacks``) and
  of the objects inside it (``schedule``, ``options``, ``selection`` with a ``_target_``) is an
  argument of its ``_target_``: ``+callbacks.fire.save_spectraa=true`` is one line naming the
  accepted keys, not a ``TypeError`` from deep inside Hydra's ``instantiate``.
- The digits streams need scikit-learn (the ``[digits]`` extra): its install command, one line.

Example:
    >>> check_callbacks(cfg)   # raises ConfigError("callbacks.fire: FIREReinit has no argument 'save_spectraa' ...")
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator

from omegaconf import DictConfig, OmegaConf

from ..errors import ConfigError
from ..extras import MissingExtraError, require_module

HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


def check_callbacks(cfg: DictConfig) -> None:
    """Check every callback spec's keys and the digits extra.

    Args:
        cfg: the composed config (``plasticity-train``'s).

    Raises:
        ConfigError: the first mistake, as one line naming the field and what is accepted.
    """
    from .methods import check_method_targets, user_config_dirs

    check_stream_extra(cfg)
    method = cfg.get("method") or cfg.get("default_method")
    if isinstance(method, DictConfig):  # before check_arguments imports its targets (an import runs a module)
        check_method_targets(method, user_config_dirs())
    for where, spec in callback_specs(cfg):
        check_arguments(where, spec)


def callback_specs(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    """``(dotted path, spec)`` of every callback spec the run may build, groups flattened."""
    groups = [("callbacks", cfg.get("callbacks"))]
    groups += [(f"phases.{name}.callbacks", (block or {}).get("callbacks"))
               for name, block in (cfg.get("phases") or {}).items()]
    method = cfg.get("method") or cfg.get("default_method")
    if isinstance(method, DictConfig):
        groups.append(("method.callbacks", method.get("callbacks")))
    for prefix, group in groups:
        yield from _specs(prefix, group)


def _specs(prefix: str, group) -> Iterator[tuple[str, DictConfig]]:
    if not isinstance(group, DictConfig):
        return
    for name, spec in group.items():
        if isinstance(spec, DictConfig):
            yield from ([(f"{prefix}.{name}", spec)] if "_target_" in spec else _specs(f"{prefix}.{name}", spec))


def check_arguments(where: str, spec: DictConfig) -> None:
    """Every key of ``spec`` names an argument of its ``_target_`` (and so on for nested ``_target_`` nodes)."""
    from hydra.utils import get_object

    target = spec.get("_target_")
    try:
        factory = get_object(target)
    except Exception as error:  # a wrong class path: Hydra's own error, on one line
        raise ConfigError(f"{where}._target_={target!r} cannot be imported: {error}") from None
    parameters = _parameters(factory)
    if parameters is not None:
        unknown = [key for key in spec if key not in parameters and key not in HYDRA_KEYS]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, parameters, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: {_name(factory)} has no argument {key!r}{hint}; it accepts "
                              f"{', '.join(parameters)}")
    for key, value in spec.items():
        if isinstance(value, DictConfig) and "_target_" in value:
            check_arguments(f"{where}.{key}", value)


def _parameters(factory) -> list[str] | None:
    """The keyword arguments ``factory`` accepts, or None when it takes ``**kwargs`` (anything goes)."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return None
    return [name for name, p in signature.parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self"]


def _name(factory) -> str:
    return getattr(factory, "__name__", repr(factory))


def check_stream_extra(cfg: DictConfig) -> None:
    """The digits task streams load scikit-learn's bundled digits: the ``[digits]`` extra."""
    target = OmegaConf.select(cfg, "data._target_") or ""
    if target.startswith("plasticity_callbacks.data.digits."):
        try:
            require_module("sklearn", "digits", f"data={target.rsplit('.', 1)[-1]} (the digits task streams)")
        except MissingExtraError as error:
            raise ConfigError(str(error)) from None
