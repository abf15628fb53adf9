"""The constant methods of a program: what ExecuTorch's LLM runner reads (``get_max_seq_len``, ``get_eos_ids``,
...), and our own for custom runners (``get_<method>_max_tokens``, ``get_adapters``)."""

from __future__ import annotations

from typing import Any

import torch

from exporters.program.adapters import ADAPTERS_CONSTANT
from exporters.program.methods import MethodSpec
from models.checkpoint import Checkpoint
from models.decoder import DecoderArgs


#: The token id of each of the draft's logits, when its lm_head scores a few (draft.vocab): an int64 tensor.
DRAFT_VOCAB = "get_draft_vocab"


def constant_methods(args: DecoderArgs, checkpoint: Checkpoint, specs: dict[str, MethodSpec], max_seq_len: int,
                     dynamic_shapes: bool, adapters: list[str] | None = None,
                     draft_vocab: torch.Tensor | None = None) -> dict[str, Any]:
    values: dict[str, Any] = {
        "get_max_seq_len": max_seq_len,
        "get_max_context_len": args.max_context_len,
        "get_vocab_size": args.vocab_size,
        "get_n_layers": args.num_hidden_layers,
        "use_kv_cache": True,
        "enable_dynamic_shape": dynamic_shapes,
    }
    if checkpoint.bos_id is not None:
        values["get_bos_id"] = checkpoint.bos_id
    if checkpoint.eos_ids:
        values["get_eos_ids"] = list(checkpoint.eos_ids)
    for name, spec in specs.items():
        if spec.takes == "features":  # audio_encoder counts windows, not tokens: get_max_audio_windows says them
            continue
        values[f"get_{name}_max_tokens"] = spec.max_tokens
        if spec.dynamic and spec.min_tokens > 1:  # verify: 2..K+1 tokens (without it, exactly max_tokens)
            values[f"get_{name}_min_tokens"] = spec.min_tokens
        if spec.kind == "verify":  # the most proposals verify checks per call (the last accepted token comes first)
            values["get_draft_tokens"] = spec.max_tokens - 1
    if args.attention_sink:  # export_llm's names: the sink, and the window each layer sees beside it
        values["attention_sink_size"] = args.attention_sink
        values["attention_sink_window_size"] = args.max_context_len - args.attention_sink
    if adapters:  # the adapters' names, so a runner finds <adapter>_<method> from the program alone
        values[ADAPTERS_CONSTANT] = ",".join(adapters)
    if draft_vocab is not None:
        values[DRAFT_VOCAB] = draft_vocab
    return values


def recorded(values: dict[str, Any]) -> dict[str, Any]:
    """The constants as the manifest records them: a tensor by its dtype and shape."""
    return {k: f"{str(v.dtype).removeprefix('torch.')} tensor {list(v.shape)}" if isinstance(v, torch.Tensor) else v
            for k, v in values.items()}
