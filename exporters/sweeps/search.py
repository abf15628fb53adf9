"""What an Optuna search (``--config-name search``) optimizes: one number per trial, from the job's row.

Optuna's sweeper takes the task function's return value as the trial's objective. A trial whose program
exceeds the quality bound (``search.max_ppl_increase``) is infeasible: it scores ``inf``, the worst possible
for a minimized objective, so the sampler learns to stay away. A trial that failed scores ``nan``, which
Optuna records as a failed trial; either way the sweep goes on and the summary shows every trial.
"""

from __future__ import annotations

import logging
import math

from exporters.config import SearchConfig
from exporters.sweeps.summary import JobRow

log = logging.getLogger("exporters")


def objective(row: JobRow, search: SearchConfig) -> float:
    if not row.ok:
        return math.nan
    value = getattr(row, search.objective)
    if value is None:
        log.warning("job %d: %s was not measured (validate or bench off?): the trial counts as failed",
                    row.job, search.objective)
        return math.nan
    bound = search.max_ppl_increase
    if bound is not None and (row.ppl_increase is None or row.ppl_increase > bound):
        log.info("job %d: perplexity increase %s is over the bound %.1f%%: infeasible", row.job,
                 "not measured" if row.ppl_increase is None else f"{row.ppl_increase:.1%}", 100 * bound)
        return math.inf
    return float(value)
