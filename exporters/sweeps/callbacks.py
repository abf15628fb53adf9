"""Hydra callbacks (``hydra.callbacks`` in ``conf/config.yaml``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("exporters")


class SweepSummary(Callback):
    """At the end of every ``-m`` run, gather the jobs' rows into the sweep folder's summary files.

    Runs in the process that launched the sweep, after every launcher (joblib, submitit, Ray) has
    returned; the rows were written by the jobs themselves, wherever they ran (``exporters.sweeps.job``).
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from exporters.sweeps.summary import SUMMARY_FILES, labels, write_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = write_summary(sweep_dir)
        ok = sum(r.ok for r in rows)
        log.info("sweep: %d jobs, %d ok, %d failed. Summary: %s", len(rows), ok, len(rows) - ok,
                 ", ".join(str(sweep_dir / name) for name in SUMMARY_FILES))
        label = labels(rows)
        for row in rows:
            if not row.ok:
                log.info("  job %d (%s) failed: %s", row.job, label[row.job], row.reason.splitlines()[0][:300])
