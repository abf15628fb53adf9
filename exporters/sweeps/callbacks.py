"""Hydra callbacks (``hydra.callbacks`` in ``conf/config.yaml``)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from exporters.errors import UserError
from exporters.output.folder import check_writable
from exporters.sweeps.summary import SUMMARY_FILES, labels, write_summary

log = logging.getLogger("exporters")


class SweepSummary(Callback):
    """At the end of every ``-m`` run, gather the jobs' rows into the sweep folder's summary files.

    Runs in the process that launched the sweep, after every launcher (joblib, submitit, Ray) has
    returned; the rows were written by the jobs themselves, wherever they ran (``exporters.sweeps.job``).
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir)
        ok = sum(r.ok for r in rows)
        log.info("sweep: %d jobs, %d ok, %d failed. Summary: %s", len(rows), ok, len(rows) - ok,
                 ", ".join(str(sweep_dir / name) for name in SUMMARY_FILES))
        label = labels(rows)
        for row in rows:
            if not row.ok:
                log.info("  job %d (%s) failed: %s", row.job, label[row.job], row.reason.splitlines()[0][:300])


class FolderCheck(Callback):
    """Before Hydra creates the run (or sweep) folder and opens its log file there: a folder that cannot be written
    is one paragraph and exit code 2, where Hydra itself would end in a traceback (``PermissionError`` from its
    ``mkdir``, or ``Unable to configure handler 'file'``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.run.dir, "the run folder (hydra.run.dir)", "hydra.run.dir=<dir>")
        if config.export.output_dir:
            self._check(config.export.output_dir, "the output folder (export.output_dir)", "export.output_dir=<dir>")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._check(config.hydra.sweep.dir, "the sweep folder (hydra.sweep.dir)", "hydra.sweep.dir=<dir>")

    @staticmethod
    def _check(folder: str, what: str, option: str) -> None:
        try:
            check_writable(Path(folder), what, f"Choose a folder you can write: {option} on the command line.")
        except UserError as e:
            print(f"export failed: {e}", file=sys.stderr)  # Hydra has not set up logging yet
            sys.exit(2)
