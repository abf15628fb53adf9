"""Where a model's checkpoint comes from: ``model.source`` in ``conf/model/*.yaml`` picks one.

Each source returns a :class:`Checkpoint` (config, weight files, tokenizer, bos/eos ids); loading the
weights is the same code for all of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from models.checkpoint import Checkpoint, open_checkpoint
from models.errors import ModelError
from models.families import FAMILIES
from models.tiny import write_tiny_checkpoint

CheckpointSource = Callable[[Any, Path], Checkpoint]

SOURCES: dict[str, CheckpointSource] = {}

REQUIRED_ARCH = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def register_source(name: str) -> Callable[[CheckpointSource], CheckpointSource]:
    def wrap(fn: CheckpointSource) -> CheckpointSource:
        SOURCES[name] = fn
        return fn

    return wrap


def arch_overrides(model_cfg: Any) -> dict[str, Any]:
    arch = model_cfg.arch
    items = dataclasses.asdict(arch) if dataclasses.is_dataclass(arch) else dict(arch)
    return {k: v for k, v in items.items() if v is not None}


def random_init_config(model_cfg: Any, overrides: dict[str, Any]) -> Any:
    """A transformers config of ``model.family`` built from ``model.arch`` alone (no checkpoint)."""
    from transformers import AutoConfig

    if model_cfg.family is None:
        raise ModelError(
            f"model={model_cfg.name} with model.random_init=true and no model.checkpoint cannot tell which family "
            f"to build. Pick one: model=<family> with family one of {', '.join(FAMILIES)}."
        )
    missing = [k for k in REQUIRED_ARCH if k not in overrides]
    if missing:
        raise ModelError(
            "model.random_init=true without model.checkpoint builds the architecture from model.arch, but "
            f"{', '.join('model.arch.' + k for k in missing)} is not set. Set them, e.g. model.arch.hidden_size=768, "
            "or give model.checkpoint to take the architecture from its config.json."
        )
    family = FAMILIES[model_cfg.family]
    return AutoConfig.for_model(family.model_type, **overrides, architectures=[family.architectures[0]],
                                bos_token_id=1, eos_token_id=2)


@register_source("hf")
def hf_checkpoint(model_cfg: Any, work_dir: Path) -> Checkpoint:
    """A Hugging Face checkpoint directory on disk (``model.checkpoint``)."""
    overrides = arch_overrides(model_cfg)
    if model_cfg.checkpoint is None:
        if not model_cfg.random_init:
            raise ModelError(
                f"model={model_cfg.name} needs a checkpoint: add model.checkpoint=/path/to/hf_dir (a directory with "
                "config.json, *.safetensors, tokenizer.json or tokenizer.model, generation_config.json), or "
                "model.random_init=true with the architecture in model.arch.* to benchmark random weights."
            )
        config = random_init_config(model_cfg, overrides)
        return Checkpoint(path=Path("<random-init>"), hf_config=config, weight_files=[], bos_id=1, eos_ids=[2])
    ckpt = open_checkpoint(model_cfg.checkpoint, need_weights=not model_cfg.random_init)
    apply_arch_overrides(ckpt.hf_config, overrides, model_cfg.checkpoint)
    return ckpt


def apply_arch_overrides(config: Any, overrides: dict[str, Any], source: str) -> None:
    """Set ``model.arch.*`` on a checkpoint's config, each where transformers reads it.

    RoPE's base lives in ``rope_parameters`` (transformers 5 ignores a ``rope_theta`` attribute once those
    exist), so it is written there; a config with one RoPE table per layer type has no single base to set.
    """
    for key, value in overrides.items():
        setattr(config, key, value)
    if "rope_theta" in overrides:
        config.standardize_rope_params()
        params = config.rope_parameters or {}
        if "rope_theta" not in params:
            raise ModelError(
                f"model.arch.rope_theta cannot be applied to {source}: its config.json has one RoPE table per layer "
                f"type ({', '.join(params)}), each with its own base. Edit rope_parameters in config.json instead."
            )
        params["rope_theta"] = overrides["rope_theta"]


@register_source("tiny")
def tiny_checkpoint(model_cfg: Any, work_dir: Path) -> Checkpoint:
    """A deterministic tiny model of ``model.family`` with a trained tokenizer, written into the run folder."""
    path = write_tiny_checkpoint(work_dir / "checkpoint", arch=arch_overrides(model_cfg), seed=model_cfg.seed,
                                 family=model_cfg.family or "llama")
    return open_checkpoint(path)
