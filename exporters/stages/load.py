"""Load: pick the checkpoint source, build the exportable decoder, load its weights and attach its adapters.

Adapters (``model.adapters``) are read and checked against the loaded base here, the first stage, so a
folder that does not fit fails before any long stage; PEFT attaches them (``models.lora``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

from exporters.config import Attention, KvDType, ModelConfig
from exporters.footprint import MemoryBudget
from exporters.stages.artifacts import EagerModel
from exporters.stages.pipeline import ExportContext, Stage
from models.checkpoint import build_model, stored_bytes
from models.families import family_of_config
from models.lora import attach_adapters, read_adapter
from models.sources import SOURCES

log = logging.getLogger("exporters")


class LoadStage(Stage):
    name = "load"

    def __init__(self, model_cfg: ModelConfig, max_context_len: int, work_dir: Path,
                 attention: Attention = Attention.aten, kv_dtype: KvDType = KvDType.fp32, attention_sink: int = 0,
                 call_tokens: int | None = None, budget: MemoryBudget | None = None) -> None:
        """``call_tokens``: most tokens one call writes (ring caches keep room for them). ``budget``: the export's
        estimated memory is checked against it from the shapes alone, before any weight is read."""
        self.budget = budget
        self.cfg = model_cfg
        self.attention = attention
        self.kv_dtype = kv_dtype
        self.attention_sink = attention_sink
        self.call_tokens = call_tokens
        self.max_context_len = max_context_len
        self.work_dir = work_dir

    def run(self, artifact: None, ctx: ExportContext) -> EagerModel:
        checkpoint = SOURCES[self.cfg.source](self.cfg, self.work_dir)
        ctx.checkpoint = checkpoint
        build = functools.partial(build_model, checkpoint, self.max_context_len, family=self.cfg.family,
                                  random_init=self.cfg.random_init, seed=self.cfg.seed, attention=self.attention,
                                  kv_dtype=self.kv_dtype, attention_sink=self.attention_sink,
                                  call_tokens=self.call_tokens)
        if self.budget is not None:
            shapes = build(device="meta")
            ctx.footprint = self.budget.check(shapes, stored_bytes(checkpoint, shapes))
            log.info("  load: %s", ctx.footprint.describe())
        model = build()
        ctx.adapters = [read_adapter(name, folder, model) for name, folder in self.cfg.adapters.items()]
        attach_adapters(model, ctx.adapters)
        return EagerModel(model)

    def describe(self, loaded: EagerModel, ctx: ExportContext) -> str:
        assert ctx.checkpoint is not None
        family = family_of_config(ctx.checkpoint.hf_config)
        adapters = "".join(f"; adapter {a.describe()}" for a in ctx.adapters)
        return f"{family.name if family else 'unknown'} family, {loaded.summary()}{adapters}"
