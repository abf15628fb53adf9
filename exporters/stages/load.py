"""Load: pick the checkpoint source, build the exportable decoder and load its weights."""

from __future__ import annotations

from pathlib import Path

from exporters.stages.artifacts import LoadedModel
from exporters.config import ModelConfig
from exporters.stages.pipeline import Stage
from models.checkpoint import build_model
from models.sources import SOURCES


class LoadStage(Stage):
    name = "load"

    def __init__(self, model_cfg: ModelConfig, max_seq_len: int, work_dir: Path, attention: str = "aten") -> None:
        self.cfg = model_cfg
        self.attention = attention
        self.max_seq_len = max_seq_len
        self.work_dir = work_dir

    def run(self, artifact: None) -> LoadedModel:
        checkpoint = SOURCES[self.cfg.source](self.cfg, self.work_dir)
        model = build_model(checkpoint, self.max_seq_len, family=self.cfg.family, random_init=self.cfg.random_init,
                            seed=self.cfg.seed, attention=self.attention)
        return LoadedModel(model=model, checkpoint=checkpoint, max_seq_len=self.max_seq_len)
