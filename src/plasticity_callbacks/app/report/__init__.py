"""``plasticity-report RUN_DIR``: a sweep's runs, or a task stream's, as one markdown table and a few figures.

A folder of task-stream runs gets the stream report (:mod:`.streams`); any other folder of runs the
sweep report (:mod:`.runs`). Both write ``report.md`` and PNGs into ``RUN_DIR/report/`` (or ``--out``).

Example:
    $ plasticity-report multirun/2026-01-01/12-00-00
"""
from __future__ import annotations

from ...extras import require_app

require_app()  # the [app] extra: one line naming the install, before the imports that need it

import argparse
from pathlib import Path

from .metric_logs import RunFolderError
from .runs import build_report
from .streams import build_stream_report, has_stream_runs


def main(argv: list[str] | None = None) -> None:
    """The console script: parse ``argv``, write the report, print it and the files written."""
    parser = argparse.ArgumentParser(prog="plasticity-report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a sweep directory (multirun/...) or a single run directory")
    parser.add_argument("--out", type=Path, default=None, help="where to write report.md and the PNGs "
                                                                "(default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        report = build_stream_report if has_stream_runs(args.run_dir) else build_report
        text, figures = report(args.run_dir, args.out)
    except FileNotFoundError as err:
        parser.exit(2, f"plasticity-report: {err}\n")
    except RunFolderError as err:  # a damaged or foreign file in the folder: named, one line
        parser.exit(1, f"plasticity-report: {err}\n")
    print(text)
    print("\n".join(f"wrote {p}" for p in [(args.out or args.run_dir / "report") / "report.md", *figures]))
