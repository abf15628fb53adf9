"""What the console shows: our stages, progress and summary. Everything else goes to the run's log.

Libraries talk a lot during an export: Python warnings (FutureWarning from torch and ExecuTorch), INFO
lines on the root logger, and the C++ runtime and cpuinfo writing straight to file descriptor 2 ("No temp
allocator provided", once per kernel call). They go to ``llm.log`` (or nowhere, for ``exporters.generate``);
``verbose=true`` puts them back on the console.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

VERBOSE = False  # set from the command line's verbose=true
OWN_LOGGERS = ("exporters", "models")

log = logging.getLogger("exporters")


def set_verbose(verbose: bool) -> None:
    """The runtime commands' ``verbose=``: true shows every library's output, false hides their warnings too."""
    global VERBOSE
    VERBOSE = verbose
    if not verbose:
        warnings.simplefilter("ignore")


class StoryFilter(logging.Filter):
    """Console filter: this tool's own records (``exporters`` and ``models``: a GGUF dequantized or a tiny model
    trained in load says so), and errors from anyone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return VERBOSE or record.name.split(".")[0] in OWN_LOGGERS or record.levelno >= logging.ERROR


@contextlib.contextmanager
def native_stderr_to(path: str | Path | None) -> Iterator[None]:
    """Send what native code writes to file descriptor 2 into ``path`` (appended; None = discarded).

    Python's own stderr is the same descriptor, so a traceback printed after this block still reaches
    the terminal: the descriptor is restored on the way out, exception or not.
    """
    if VERBOSE:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(os.devnull if path is None else str(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.dup2(target, 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def log_file() -> Path | None:
    """The file the root logger writes to (Hydra's ``<run folder>/llm.log``), if any."""
    return next((Path(h.baseFilename) for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)),
                None)


def count(n: int) -> str:
    """A number of parameters as a reader takes it in: 20K, 1.5M, 1.54B (a 20K-parameter draft is not "0.0M")."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _agreement(report: Any) -> str:
    """Greedy agreement as every line shows it: to a tenth of a percent (99.6% is not rounded up to 100%)."""
    return f"top-1 agreement {report.top1_agreement:.1%}"


def _verdict(report: Any) -> str:
    """An adapter's or another component's validation (a ``ValidationReport`` or None) in one phrase."""
    if report is None:
        return "not validated"
    return f"{'passed' if report.passed else 'FAILED'} (KL {report.kl_mean:.2g}, {_agreement(report)}), {report.quality()}"


def _other_methods(m: Any) -> str:
    """The methods of the program's other components (a draft's, a vision encoder's), after the decoder's."""
    return "".join(f"; {', '.join(c.methods)} ({name})" for name, c in m.components.items() if c.kind != "decoder")


def log_speech_summary(result: Any, name: str, c: Any) -> None:
    """The closing lines of a speech program's export."""
    m, s = result.manifest, c.speech
    check = s.check
    log.info(
        "exported %s\n  size: %.2f MB  sha256: %s; %s beside it (raw samples to features)\n"
        "  methods: %s (ExecuTorch's AsrRunner layout)\n"
        "  %s: whisper, %s parameters, %d mel bins, %d decoder positions per %d s window; encoder %s, decoder %s\n"
        "  validation: %s%s\n  export: %s%s\n  manifest: %s",
        result.pte_path, m.program.size_bytes / 1e6, m.program.sha256[:16], s.preprocessor, ", ".join(c.methods),
        name, count(c.parameters or 0), s.mel_bins, s.max_tokens, s.chunk_seconds, s.quantization["encoder"],
        s.quantization["decoder"], "skipped (validate=false)" if check is None else check.describe(),
        "" if check is None else f"\n  transcript of {check.recording}: {check.transcript.strip()!r}",
        m.resources.describe(), "" if m.bench is None else "\n  runtime: " + m.bench.describe(), result.manifest_path)


def log_export_summary(result: Any) -> None:
    """The closing lines of an export (an ``ExportResult``): what was written, how it runs, how good it is."""
    m = result.manifest
    speech = next(((n, c) for n, c in m.components.items() if c.speech is not None), None)
    if speech is not None:
        log_speech_summary(result, *speech)
        return
    validation = m.validation
    verdict = "skipped (validate=false)" if validation is None else (
        f"passed (KL {validation.kl_mean:.2g}, {_agreement(validation)})"
        + ("" if validation.checked == "runtime" else f"; checked on the {validation.checked}"))
    quality = "not measured (validate=false)" if validation is None else (
        f"{validation.quality()} on {validation.scored_tokens} tokens of {validation.text}")
    runners = "; ".join(f"{release} {o.result.upper() if o.result != 'correct' else o.result}"
                        for release, o in m.layout.stock_runners.items())
    swap = m.swappable
    adapters = "".join(
        (f"\n  adapter {name}: {swap.adapters[name].file} ({swap.adapters[name].size_bytes / 1e6:.2f} MB), set with "
         f"{swap.method}; " if swap is not None and name in swap.adapters else
         f"\n  adapter {name}: {', '.join(a.methods.values())}; ") + _verdict(a.validation)
        + ("" if a.data is None else f"; its weights in {a.data.file} ({a.data.size_bytes / 1e6:.2f} MB)")
        for name, a in m.adapters.items())
    slots = "" if swap is None else (
        f"; {swap.method}: LoRA slots of rank {swap.slots['rank']} on "
        f"{', '.join(t['kind'] for t in swap.slots['targets'])}, any PEFT adapter that fits (docs/adapters.md)")
    others = "".join(
        f"\n  {name}: {', '.join(c.methods)}; {c.family or 'unknown'} family, {count(c.parameters or 0)} "
        f"parameters, {c.quantization.describe() if c.quantization else 'not quantized'}; "
        f"{c.assistant.describe() if c.assistant is not None else _verdict(c.validation)}"
        for name, c in m.components.items() if c.kind != "decoder" and c.vision is None and c.audio is None) + "".join(
        f"\n  {name}: {', '.join(c.methods)}; {encoder.describe()}, {count(c.parameters or 0)} parameters"
        for name, c in m.components.items() for encoder in (c.vision, c.audio) if encoder is not None)
    speculative = ("" if validation is None or validation.speculative is None
                   else f"\n  speculative: {validation.speculative.describe()}")
    data = "" if m.data is None else f" + {m.data.file} {m.data.size_bytes / 1e6:.2f} MB (the weights)"
    log.info(
        "exported %s\n  size: %.2f MB%s  sha256: %s\n  methods: %s (layout %s)\n  KV cache: %s\n  constants: %s\n"
        "  ExecuTorch stock runners: %s\n  validation: %s\n  quality: %s%s\n  export: %s%s\n"
        "  manifest: %s",
        result.pte_path, m.program.size_bytes / 1e6, data, m.program.sha256[:16],
        ", ".join(m.layout.methods) + slots + _other_methods(m),  # each adapter's are on its own line
        m.layout.name, m.kv_cache.describe() if m.kv_cache else "not recorded", ", ".join(m.constant_methods), runners, verdict, quality,
        speculative + others + adapters,
        m.resources.describe(),
        "" if m.bench is None else "\n  runtime: " + m.bench.describe(), result.manifest_path,
    )
    if m.quality_warning is not None:
        log.warning("WARNING: %s", m.quality_warning.describe())
    for release, o in m.layout.stock_runners.items():
        if o.result != "correct":
            outcome = "would fail" if o.result == "fails" else f"would print {o.result}"
            log.warning("ExecuTorch %s's stock runner %s with this program: %s. To run it there: %s.",
                        release, outcome, o.why, o.fix)

