"""Adapter methods: how a LoRA adapter's methods are named in the program, and how a reader finds them.

Each adapter (``model.adapters``) gets the base's methods computed with that adapter applied, named
``<adapter>_<method>``: ``chat_prefill``, ``chat_decode_one_token``, ``chat_forward`` (ExecuTorch's export_llm
names its adapter method ``lora_forward`` the same way, and ``llama_main --method_name=chat_forward`` runs
one). Adapter names are letters and digits (``models.lora.ADAPTER_NAME``), so the first ``_`` splits a name.
The constant method ``get_adapters`` lists the adapters, comma-separated, so a runner can discover them from
the program alone; the manifest lists each adapter's methods too.
"""

from __future__ import annotations

from typing import Collection

ADAPTERS_CONSTANT = "get_adapters"
SEPARATOR = "_"


def adapter_method(adapter: str, method: str) -> str:
    """The name of base method ``method`` with ``adapter`` applied."""
    return f"{adapter}{SEPARATOR}{method}"


def split_method(name: str, base_methods: Collection[str]) -> tuple[str | None, str]:
    """``chat_prefill`` -> ("chat", "prefill"); a base method's name -> (None, name)."""
    if name in base_methods:
        return None, name
    adapter, sep, method = name.partition(SEPARATOR)
    return (adapter, method) if sep and method in base_methods else (None, name)

