"""``python -m exporters.llm model=... quant=... backend=...``: thin Hydra entry point around ``export()``.

A single run exports in this process. In a sweep (``-m``) each job exports in a child process
(``exporters.sweeps.job``) and records a row in its folder, whatever happens to the export; the end-of-sweep
callback (``exporters.sweeps.callbacks.SweepSummary``) gathers the rows into the sweep's summary.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from exporters import console
from exporters.config import CONF_DIR, compose, register_configs
from exporters.errors import REPORTED_ERRORS, Interrupted
from exporters.help import help_text
from exporters.output.folder import remove_if_nothing_written
from exporters.output.interrupts import signal_of, sigterm_interrupts
from exporters.sweeps.job import run_sweep_job
from exporters.sweeps.search import objective

log = logging.getLogger("exporters")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def run(cfg: DictConfig) -> float | None:
    """One export, or one job of a sweep (Hydra calls it once per job)."""
    hydra_cfg = HydraConfig.get()
    output_dir = cfg.export.output_dir or hydra_cfg.runtime.output_dir
    console.VERBOSE = bool(cfg.verbose) or bool(hydra_cfg.verbose)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    if sweeping:
        with sigterm_interrupts():
            row = run_sweep_job(cfg, Path(output_dir), hydra_cfg.job.num, list(hydra_cfg.overrides.task),
                                console.log_file(), console.VERBOSE)
        return objective(row, cfg.search)
    logging.captureWarnings(True)  # warnings become records: llm.log gets them, the console filter drops them
    # The export's stack (torch, transformers, ExecuTorch: about 7 s of imports) is imported here, not at the top:
    # --help, a typo, a bad override or a folder that cannot be written is answered before it, in about a second.
    from exporters.components.resolve import plan_export
    from exporters.export import export

    try:
        with sigterm_interrupts(), console.native_stderr_to(console.log_file()):
            result = export(plan_export(cfg, overrides=list(hydra_cfg.overrides.task)), output_dir)
    except REPORTED_ERRORS as e:
        log.error("export failed: %s", e)
        remove_if_nothing_written(Path(hydra_cfg.runtime.output_dir))  # a refused export leaves no empty folder
        sys.exit(2)
    except Interrupted as e:
        log.error("export %s", e.describe())
        sys.exit(e.exit_code)
    console.log_export_summary(result)
    return None


def main() -> None:
    register_configs()  # the schema and the launcher resolvers, before Hydra composes
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:  # every field with what it does (Hydra's lists none)

        overrides = [a for a in sys.argv[1:] if a not in ("--help", "-h") and not a.startswith("-")]
        try:
            print(help_text(compose(*overrides)), end="")
        except Exception as e:  # a bad override: say so as an export would
            print(f"cannot compose {' '.join(overrides)}: {e}", file=sys.stderr)
            sys.exit(2)
        return
    try:
        run()
    except KeyboardInterrupt as stop:  # a sweep interrupted (one export says so itself): its job said what was kept
        sys.exit(Interrupted("sweep", signal_of(stop)).exit_code)


if __name__ == "__main__":
    main()
