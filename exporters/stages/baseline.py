"""Reference: score the unquantized model on the validation text, before quantization changes it.

Cuts the validation text into the windows validation will drive the program over, and records the
unquantized model's negative log-likelihood on them (the "fp32" perplexity of the summary line).
"""

from __future__ import annotations

from exporters.stages.artifacts import LoadedModel, ReferenceQuality
from exporters.config import ValidationConfig
from exporters.stages.pipeline import Stage
from exporters.runtime.quality import full_sequence, make_windows, read_text, text_ids, window_logits
from exporters.quant.schemes import DTYPES


def prompt_length(requested: int, max_seq_len: int, static_chunk: int | None) -> int:
    """Prompt tokens per window: at most half the context, so each window has tokens left to decode; on
    static-shape backends a whole number of prefill chunks (no padding)."""
    tokens = min(requested, max(1, max_seq_len // 2))
    if static_chunk is None:
        return tokens
    return max(static_chunk, tokens - tokens % static_chunk)


class ReferenceStage(Stage):
    name = "reference"

    def __init__(self, validation_cfg: ValidationConfig, prompt_tokens: int, enabled: bool) -> None:
        self.cfg = validation_cfg
        self.prompt_tokens = prompt_tokens
        self.enabled = enabled

    def run(self, loaded: LoadedModel) -> LoadedModel:
        if not self.enabled:
            return loaded
        text, source = read_text(self.cfg.text_file)
        model = loaded.model
        ids = text_ids(loaded.checkpoint, model.args.vocab_size, text)
        windows = make_windows(ids, loaded.checkpoint.bos_id, loaded.max_seq_len, self.prompt_tokens,
                               self.cfg.max_tokens, source)
        logits = window_logits(full_sequence(model), windows)
        model.reset_cache()
        nll = windows.nll(logits)
        dtype_name = {v: k for k, v in DTYPES.items()}.get(model.lm_head.weight.dtype, str(model.lm_head.weight.dtype))
        loaded.reference = ReferenceQuality(text=windows, nll=nll, dtype=dtype_name)
        return loaded
