"""The constant methods of a program: what ExecuTorch's LLM runner reads (``get_max_seq_len``, ``get_eos_ids``,
...), and our own for custom runners (``get_<method>_max_tokens``, ``get_adapters``)."""

from __future__ import annotations

from typing import Any

from exporters.program.adapters import ADAPTERS_CONSTANT
from exporters.program.methods import MethodSpec
from models.checkpoint import Checkpoint
from models.decoder import DecoderArgs


def constant_methods(args: DecoderArgs, checkpoint: Checkpoint, specs: dict[str, MethodSpec], max_seq_len: int,
                     dynamic_shapes: bool, adapters: list[str] | None = None) -> dict[str, Any]:
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
        values[f"get_{name}_max_tokens"] = spec.max_tokens
        if spec.kind == "verify":  # the proposals verify checks per call (the last accepted token comes first)
            values["get_draft_tokens"] = spec.max_tokens - 1
    if args.attention_sink:  # export_llm's names: the sink, and the window each layer sees beside it
        values["attention_sink_size"] = args.attention_sink
        values["attention_sink_window_size"] = args.max_context_len - args.attention_sink
    if adapters:  # the adapters' names, so a runner finds <adapter>_<method> from the program alone
        values[ADAPTERS_CONSTANT] = ",".join(adapters)
    return values
