"""``plasticity-train``: the Hydra entry point (``python -m plasticity_callbacks.app.train`` does the same).

Check the command line (``config_checks.py``), compose the config, check it; with ``phases:``
(the default, ``experiment=pretrain_sft``) run the multi-phase pipeline (``pipeline.py``), else
one fit: instantiate data, model, callbacks, logger and trainer, fit, print a summary. After its first
steps a run prints how long it will take on this machine (``time_estimate.py``). Every run
ends by writing its figures (``report/``, see ``report.py``) and printing where its outputs are.
"""
from __future__ import annotations

from ..extras import require_app

require_app()  # the [app] extra: one line naming the install, before the imports that need it

import logging
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..distributed.process_group import end_process_group
from ..errors import CheckpointError
from .runs.checkpoints import RunInterrupted, VerifiedCheckpointIO, read_checkpoint
from .runs.verified_files import hashes_remembered
from .runs.resume import ResumeError, ResumeGuard, RunLock, resume_checkpoint, run_fingerprint
from ..models.lightning_module import GPTLightningModule, check_data_fits_model
from ..errors import ConfigError
from .callback_checks import check_callbacks
from .config_checks import check_command_line, check_config, config_dir
from .console import configure_run_output
from .methods import task_stream_callbacks, with_method_settings
from .pipeline import Pipeline, instantiate_callbacks, module_on_meta, resolve_method
from .runs.resumed_logs import LogPosition, restore_logs
from .progress import progress_callbacks
from .time_estimate import TimeEstimate

log = logging.getLogger(__name__)


def with_stream_method(cfg: DictConfig) -> DictConfig:
    """A task stream's config with its method's ``model:``/``optimizer:`` settings merged in
    (:func:`~app.methods.with_method_settings`); any other single fit's as it is (it takes no method)."""
    return with_method_settings(cfg, resolve_method(cfg)) if cfg.get("method_at_task_boundaries") else cfg


def build_module(cfg: DictConfig) -> L.LightningModule:
    if "_target_" in cfg.model:  # any other LightningModule, e.g. model=digits_mlp for the task streams
        return instantiate(cfg.model, _convert_="all")
    return GPTLightningModule(OmegaConf.to_container(cfg.model, resolve=True),
                              optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True))


def build_callbacks(cfg: DictConfig) -> list[L.Callback]:
    """Every entry of ``cfg.callbacks`` (``+callbacks=fire`` adds one), the method's callbacks when it acts
    at task boundaries (``method_at_task_boundaries: true``, the task streams), and the checkpointing."""
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    if cfg.get("method_at_task_boundaries"):
        callbacks += instantiate_callbacks(task_stream_callbacks(resolve_method(cfg)))
    return callbacks + [LogPosition(), instantiate(cfg.checkpoint)]


def fit(cfg: DictConfig) -> dict[str, Any]:
    started = time.perf_counter()  # the run's minutes and its time estimate count its set-up too
    cfg = with_stream_method(cfg)  # l2, ln_wd: the method's model and optimizer settings
    ckpt_path = resume_checkpoint(cfg.ckpt_path, cfg.paths.checkpoint_dir)  # before anything runs
    L.seed_everything(cfg.seed, workers=True)
    if cfg.get("threads"):
        torch.set_num_threads(cfg.threads)
    # _convert_="all": plain lists/dicts, so checkpoints hold no OmegaConf objects and load with weights_only.
    datamodule = instantiate(cfg.data, _convert_="all")
    module = build_module(cfg)
    if isinstance(module, GPTLightningModule):
        check_data_fits_model(datamodule, module.config)
    guard = ResumeGuard(config=run_fingerprint(cfg), allow_changes=list(cfg.get("resume_allow_changes") or []))
    callbacks = [guard, *build_callbacks(cfg)]
    if cfg.trainer.get("max_steps", -1) > 0:
        callbacks.append(TimeEstimate([("fit", cfg.trainer.max_steps)], started=started))
    callbacks += progress_callbacks(cfg.trainer)  # plain lines when stdout is not a terminal
    resumed_from = read_checkpoint(ckpt_path, mmap=True) if ckpt_path is not None else None
    if resumed_from is not None:  # refuse before anything touches the run's logs
        guard.check(resumed_from, callbacks, module, ckpt_path)
    logger = instantiate(cfg.logger)
    restore_logs(logger, resumed_from)  # the rows logged up to the checkpoint, once (resumed_logs.py)
    trainer: L.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger, plugins=[VerifiedCheckpointIO()])
    if cfg.validate_before_fit and ckpt_path is None:
        guard.carried["val_loss_before"] = trainer.validate(module, datamodule=datamodule, verbose=False)[0].get("val/loss")
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = guard.metrics_with_restored(trainer)  # with what was logged before an interruption
    summary = {
        "parameters": sum(p.numel() for p in module.parameters()),
        "steps": trainer.global_step,
        "tokens_seen": trainer.global_step * datamodule.batch_size * getattr(datamodule, "sequence_len", 1)
        * trainer.accumulate_grad_batches * trainer.world_size,
        "val_loss_before": guard.carried.get("val_loss_before"),
        "train_loss_final": metrics.get("train/loss"),
        "val_loss_final": metrics.get("val/loss"),
        "minutes": (time.perf_counter() - started) / 60,
        "log_dir": trainer.logger.log_dir if trainer.logger is not None else None,
        "checkpoint_dir": cfg.paths.checkpoint_dir,
    }
    rank_zero_info(format_summary(summary))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(v):
        return f"{v:,.4f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)

    width = max(map(len, summary))
    return "\n".join(["", "run summary"] + [f"  {k.ljust(width)}  {fmt(v)}" for k, v in summary.items()])


def task_overrides() -> list[str]:
    """The command line's overrides of this job (empty outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def report_outputs(run_dir: Path) -> None:
    """Write the run's figures (``report/``) and say where everything is."""
    from .report.runs import build_report
    from .report.streams import build_stream_report, has_stream_runs

    lines = [f"outputs in {run_dir}:", f"  log          {run_dir / 'train.log'}"]
    lines += [f"  metrics      {p}" for p in sorted(run_dir.glob("logs/**/metrics.csv"))]
    lines += [f"  checkpoints  {p}" for p in sorted(run_dir.glob("checkpoints/**/*.ckpt"))]
    figures: list[Path] = []
    try:
        # a task stream: its per-task panels (a classifier's loss is not in nats per byte; it validates nothing)
        _, figures = (build_stream_report if has_stream_runs(run_dir) else build_report)(run_dir)
        lines.append(f"  report       {run_dir / 'report' / 'report.md'}")
    except FileNotFoundError as err:  # nothing the report reads (zero steps, or a logger with its own store)
        lines.append(f"  report       none ({err})")
    except Exception as err:  # the run's results are saved; a figure that fails must not hide them
        log.warning(f"could not draw the run's figures ({type(err).__name__}: {err}); "
                    f"plasticity-report {run_dir} retries")
    # the callbacks' own figures (FIRE's spectra, ...), wherever the logger keeps them (logs/, tensorboard/, W&B's
    # or MLflow's folders), listed even when the report had nothing to draw
    drawn = sorted(p for p in run_dir.glob("**/figures/*.png") if p not in figures)
    lines += [f"  figures      {p}" for p in [*figures, *drawn]] or ["  figures      none"]
    rank_zero_info("\n".join(lines))


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_main(cfg: DictConfig) -> float | None:
    configure_run_output()
    try:
        check_config(cfg, task_overrides())
        check_callbacks(cfg)
        run_dir = Path(cfg.paths.output_dir)
        rank_zero_info(f"run directory: {run_dir} (train.log, logs/, checkpoints/, report/)")
        if cfg.get("phases"):
            phases = Pipeline(cfg).run()["phases"]
            result = list(phases.values())[-1].get("val_loss") if phases else None
        else:
            with RunLock(cfg.paths.output_dir):
                result = fit(cfg).get("val_loss_final")
    except (ResumeError, CheckpointError) as err:
        # A refused resume or an unusable checkpoint: the one line says what and where; nothing was changed.
        print(f"plasticity-train: {err}", file=sys.stderr)
        sys.exit(1)
    except RunInterrupted as err:  # SIGTERM / SIGINT: the checkpoint of the step reached is on disk
        if rank_zero_only.rank == 0:
            print(f"plasticity-train: {err}", file=sys.stderr)
        err.wait_for_other_ranks()  # they stopped at the same step: the job ends when they have
        sys.exit(err.code)
    except (ConfigError, InstantiationException, OmegaConfBaseException) as err:
        exit_with_config_error(err)
    if rank_zero_only.rank == 0:
        report_outputs(run_dir)
    return result


def exit_with_config_error(err: Exception) -> None:
    """Bad config values: one readable line, not a traceback from deep inside; exit status 2."""
    message = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    print(f"plasticity-train: configuration error: {message}", file=sys.stderr)
    sys.exit(2)


def refuse_before_start(argv: list[str], configs: str) -> None:
    """Raise the refusal a resume would meet (ResumeError, CheckpointError) before Hydra creates the run
    directory or writes ``.hydra/`` and ``train.log`` into it: a missing run or checkpoint, a changed
    configuration, a checkpoint that is damaged, needs arbitrary code to load, or belongs to another
    phase or run, a model whose shapes differ from the checkpoint's or a callback whose state it holds
    missing (configuration changes allowed), a directory in use. Anything else (a bad value) is left to
    the run's own checks.

    Args:
        argv: the command line after the program name.
        configs: the primary config folder.
    """
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from omegaconf import open_dict

    args, _ = get_args_parser().parse_known_args(argv)
    resuming = ("ckpt_path=", "pipeline.resume=", "pipeline.init_from=", "pipeline.start_phase=")
    if args.multirun or args.config_dir or args.config_path or not any(o.startswith(resuming) for o in args.overrides):
        return
    try:
        with initialize_config_dir(config_dir=configs, version_base="1.3"):
            cfg = compose(args.config_name or "config", overrides=args.overrides, return_hydra_config=True)
        run_dir = Path(str(cfg.hydra.run.dir)).absolute()
        with open_dict(cfg):
            if OmegaConf.to_container(cfg.paths)["output_dir"] == "${hydra:runtime.output_dir}":
                cfg.paths.output_dir = str(run_dir)  # what Hydra will set; it is not running yet
            del cfg["hydra"]
        if cfg.get("phases"):
            if cfg.get("pipeline", {}).get("resume") and not run_dir.is_dir():
                raise ResumeError(f"cannot resume {run_dir} (pipeline.resume=true): there is no such directory; "
                                  "check hydra.run.dir, or drop pipeline.resume=true to start a new run")
            Pipeline(cfg).check_before_start()
        elif cfg.get("ckpt_path") is not None:
            cfg = with_stream_method(cfg)  # as fit() sees it
            path = resume_checkpoint(cfg.ckpt_path, cfg.paths.checkpoint_dir)
            guard = ResumeGuard(config=run_fingerprint(cfg), allow_changes=list(cfg.get("resume_allow_changes") or []))
            checkpoint = read_checkpoint(path, mmap=True)
            guard.check_origin(checkpoint, path)
            module = module_on_meta(lambda: build_module(cfg))
            if module is not None:  # a changed model or a removed callback (allowed changes of the configuration)
                guard.check(checkpoint, [guard, *build_callbacks(cfg)], module, path)
        if run_dir.is_dir():
            RunLock(run_dir).acquire().release()
    except (ResumeError, CheckpointError):
        raise
    except Exception:  # a bad value or option: the run's own checks report it in their words
        return


def main() -> None:
    with hashes_remembered():  # a checkpoint checked before Hydra starts is not read again to be loaded
        try:
            check_command_line(sys.argv[1:], config_dir())
            refuse_before_start(sys.argv[1:], config_dir())
        except ConfigError as err:
            exit_with_config_error(err)
        except (ResumeError, CheckpointError) as err:  # refused before Hydra writes anything into the run directory
            print(f"plasticity-train: {err}", file=sys.stderr)
            sys.exit(1)
        hydra_main()
    end_process_group()  # every rank (Lightning launches this program again for each) ends with the others


if __name__ == "__main__":
    main()
