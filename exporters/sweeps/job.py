"""One job of a sweep: the export runs in a child process, and the job records what became of it.

Why a child process: whatever happens to an export (a config that cannot work, a crash, the
out-of-memory killer's SIGKILL), the launcher's worker survives and writes a ``failed`` row with the
reason; no exception leaves the job, so Hydra finishes the sweep and its end-of-sweep callback writes the
summary. Each export also gets a fresh process: its peak RSS is its own, and its memory is returned to
the system before the worker takes the next job (joblib and Ray reuse workers).

    parent (Hydra job, any launcher)          child (python -m exporters.sweeps.job)
    config + folders as JSON on stdin   ->    export(); manifest.json; FAILED on a reported error
    os.wait4: exit status, peak RSS     <-    exit 0 / 2 (reported error) / 1 (crash) / killed
    result.json in the job folder
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from exporters import console
from exporters.config import ExportConfig, check_known_keys
from exporters.console import StoryFilter
from exporters.errors import REPORTED_ERRORS, Interrupted
from exporters.manifest import MANIFEST_FILE, Manifest
from exporters.output.interrupts import held_back, signal_of, sigterm_interrupts
from exporters.runtime.memory import wait_with_peak_rss
from exporters.sweeps.summary import SUMMARY_FILES, JobRow, write_result, write_summary

log = logging.getLogger("exporters")

FAILED_FILE = "FAILED"  # the child's one-paragraph reason when a reported error stops the export
REPORTED_ERROR_EXIT = 2


def run_sweep_job(cfg: DictConfig, job_dir: Path, job_num: int, overrides: list[str], log_file: Path | None,
                  verbose: bool) -> JobRow:
    """Export ``cfg`` into ``job_dir`` in a child process and write the job's ``result.json``."""
    job_dir.mkdir(parents=True, exist_ok=True)
    for stale in (FAILED_FILE, MANIFEST_FILE, "result.json"):  # a folder reused by a re-run: only this run's
        (job_dir / stale).unlink(missing_ok=True)
    request = {"config": OmegaConf.to_container(cfg, resolve=True), "overrides": overrides, "output_dir": str(job_dir),
               "log_file": str(log_file) if log_file else None, "label": f"job {job_num}", "verbose": verbose}
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-m", "exporters.sweeps.job", str(job_dir)], stdin=subprocess.PIPE)
    assert child.stdin is not None
    child.stdin.write(json.dumps(request).encode())
    child.stdin.close()
    try:
        child_peak_rss_mb = wait_with_peak_rss(child)
    except KeyboardInterrupt as stop:  # Ctrl-C (the terminal signals the child too) or SIGTERM to this process
        child_peak_rss_mb = _stop_child(child, signal_of(stop))
        interrupted = stop
    else:
        interrupted = None
    row = JobRow(job=job_num, overrides=" ".join(overrides), model=cfg.model.name, quant=cfg.quant.name,
                 backend=cfg.backend.name, status="ok", job_s=round(time.perf_counter() - start, 1))
    if (job_dir / MANIFEST_FILE).is_file():
        m = Manifest.read(job_dir)
        row = row.with_manifest(m, f"{job_dir.name}/{m.program.file}")
    if child.returncode != 0:
        row.status, row.reason = "failed", _failure_reason(child.returncode, job_dir)
        if row.peak_rss_mb is None:
            row.peak_rss_mb = round(child_peak_rss_mb)  # what it reached before it stopped
    write_result(job_dir, row)
    if interrupted is not None:
        # The jobs that finished keep their rows and the sweep's summary is written with them and this one; the
        # jobs not started yet are not run.

        rows = write_summary(job_dir.parent)
        log.error("sweep interrupted during job %d: %d job(s) finished before it are kept. Summary: %s", job_num,
                  sum(r.ok for r in rows), job_dir.parent / SUMMARY_FILES[0])
        raise interrupted
    return row


def _stop_child(child: subprocess.Popen, signum: signal.Signals, grace_s: float = 2.0) -> float:
    """Let the export child stop as it does on a signal (it removes what it had written): it is sent ``signum`` only
    if it has not ended within ``grace_s`` (a terminal's Ctrl-C has reached it already, and a second one could cut
    its cleanup short). Its peak RSS."""
    peak = wait_with_peak_rss(child, timeout=grace_s)
    if peak is None:
        child.send_signal(signum)
        with held_back():  # a second signal meanwhile is raised once the child is gone
            peak = wait_with_peak_rss(child)
    return peak or 0.0


def _failure_reason(returncode: int, job_dir: Path) -> str:
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hints = {signal.SIGKILL: " The out-of-memory killer sends SIGKILL when memory runs out: run fewer jobs at "
                                 "once (hydra.launcher.n_jobs, sweep.job_memory_gb) or give each more memory.",
                 signal.SIGBUS: " The system sends SIGBUS when a memory-mapped file shrinks under the process: the "
                                "checkpoint's weight files were truncated or replaced while the export read them."}
        hint = hints.get(signal.Signals(-returncode), "")
        return f"the export process was killed by {name}.{hint}"
    failed = job_dir / FAILED_FILE
    if failed.is_file():
        return failed.read_text().strip()
    return f"the export process exited with status {returncode} and left no reason; see {job_dir / 'llm.log'}."


def _configure_child_logging(label: str, log_file: str | None) -> None:
    """The story on the console, prefixed with the job; everything in the job's ``llm.log`` (as Hydra does)."""

    root = logging.getLogger()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stdout)
    console.addFilter(StoryFilter())
    console.setFormatter(logging.Formatter(f"[{label}] %(message)s"))
    root.addHandler(console)
    if log_file:
        handler = logging.FileHandler(log_file)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        root.addHandler(handler)
    logging.captureWarnings(True)


def _child_main(request: dict[str, Any]) -> int:
    # The export's stack (torch, torchao, ExecuTorch) loads in the job's child process only: Hydra's launcher
    # process imports this module and stays light.
    from exporters.components.resolve import plan_export
    from exporters.export import export

    console.VERBOSE = bool(request["verbose"])
    _configure_child_logging(request["label"], request["log_file"])
    out = Path(request["output_dir"])
    try:
        with sigterm_interrupts(), console.native_stderr_to(request["log_file"]):
            check_known_keys(OmegaConf.create(request["config"]))  # before the merge, which would only crash on one
            cfg = OmegaConf.merge(OmegaConf.structured(ExportConfig), request["config"])
            result = export(plan_export(cfg, overrides=request["overrides"], sweeping=True), out)
    except Interrupted as e:
        log.error("export %s", e.describe())
        (out / FAILED_FILE).write_text(f"{e.describe()}\n")
        return e.exit_code
    except REPORTED_ERRORS as e:
        log.error("export failed: %s", e)
        (out / FAILED_FILE).write_text(f"{e}\n")
        return REPORTED_ERROR_EXIT
    except Exception as e:  # a bug, not bad input: the traceback goes to llm.log, the row gets one line
        log.error("export crashed: %s: %s", type(e).__name__, e)
        (out / FAILED_FILE).write_text(f"crashed: {type(e).__name__}: {e} (traceback in llm.log)\n")
        if request["log_file"]:
            with open(request["log_file"], "a") as f:
                traceback.print_exc(file=f)
        return 1
    console.log_export_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(json.loads(sys.stdin.read())))
