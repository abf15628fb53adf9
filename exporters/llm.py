"""``python -m exporters.llm model=... quant=... backend=...``: thin Hydra entry point around ``export()``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from exporters import console
from exporters.api import export
from exporters.config import CONF_DIR
from exporters.errors import REPORTED_ERRORS

log = logging.getLogger("exporters")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    output_dir = cfg.export.output_dir or HydraConfig.get().runtime.output_dir
    console.VERBOSE = bool(cfg.verbose) or bool(HydraConfig.get().verbose)
    logging.captureWarnings(True)  # warnings become records: llm.log gets them, the console filter drops them
    try:
        with console.native_stderr_to(console.log_file()):
            result = export(cfg, output_dir)
    except REPORTED_ERRORS as e:
        log.error("export failed: %s", e)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # A sweep goes on with its other configs; this job's folder says why it failed.
            (Path(output_dir) / "FAILED").write_text(f"{e}\n")
            return
        sys.exit(2)
    m = result.manifest
    validation = m["validation"]
    verdict = "skipped (validate=false)" if validation is None else (
        f"passed (KL {validation['kl_mean']:.2g}, top-1 agreement {validation['top1_agreement']:.0%})"
        + ("" if validation["checked"] == "runtime" else f"; checked on {validation['checked']}"))
    quality = "not measured (validate=false)" if validation is None else validation["quality"]
    runners = "; ".join(f"{release} {o['result'].upper() if o['result'] != 'correct' else o['result']}"
                        for release, o in m["layout"]["stock_runners"].items())
    log.info(
        "exported %s\n  size: %.2f MB  sha256: %s\n  methods: %s (layout %s)\n  constants: %s\n"
        "  ExecuTorch stock runners: %s\n  validation: %s\n  quality: %s\n  manifest: %s",
        result.pte_path, m["program"]["size_bytes"] / 1e6, m["program"]["sha256"][:16],
        ", ".join(m["methods"]), m["layout"]["name"], ", ".join(m["constant_methods"]), runners, verdict, quality,
        result.manifest_path,
    )
    for release, o in m["layout"]["stock_runners"].items():
        if o["result"] != "correct":
            log.warning("ExecuTorch %s's stock runner would give %s with this program: %s. export.layout=stock "
                        "(with forward in export.methods) makes a program every stock runner runs correctly.",
                        release, o["result"], o["why"])


if __name__ == "__main__":
    main()
