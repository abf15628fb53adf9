"""Read a Hugging Face checkpoint directory into the exportable decoder.

Only safetensors are read (no pickle). The model is built on the meta device and each tensor, in the
checkpoint's own dtype, is assigned into it (``load_state_dict(assign=True)``). The tensors are
copy-on-write views of the memory-mapped files: no second copy exists, pages are read when first used,
and the file itself is never written. Peak memory is measured by ``python -m benchmarks.load_memory``.
Every file problem is a :class:`ModelError` naming the file (and tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from models.ctranslate2 import ct2_record, is_ctranslate2, whisper_checkpoint
from models.decoder import CausalLM
from models.errors import ModelError
from models.tokenizer import CHAT_TEMPLATE_FILE
from models.vision import PROCESSOR_FILES
from models.families import decoder_args, tensor_namer
from models.lora import WEIGHTS_FILE as ADAPTER_WEIGHTS_FILE

log = logging.getLogger(__name__)

WEIGHTS_INDEX = "model.safetensors.index.json"
# Copied next to the program: what the runner and chat templates need.
TOKENIZER_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                        CHAT_TEMPLATE_FILE, *PROCESSOR_FILES)
# Buffers some checkpoints carry that this decoder recomputes itself.
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class Checkpoint:
    """What a checkpoint directory holds, checked but not yet loaded."""

    path: Path
    hf_config: Any
    weight_files: list[Path]
    tokenizer_files: list[Path] = field(default_factory=list)
    generation_config_file: Path | None = None
    bos_id: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    # Where the folder came from when it was converted (a GGUF file: its path, quant type, dequantized).
    converted_from: dict[str, Any] | None = None
    # Each weight file's (size, modification time) when the checkpoint was opened: check_unchanged compares.
    weight_stats: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.weight_stats:
            self.weight_stats = {f: _stat(f) for f in self.weight_files if f.exists()}

    def check_unchanged(self) -> None:
        """Refuse weight files that changed since the checkpoint was opened (still being copied or downloaded, or
        replaced): their tensors are read lazily, so the export would hold a mix of two versions."""
        changed = [f for f, seen in self.weight_stats.items() if not f.exists() or _stat(f) != seen]
        if changed:
            f = changed[0]
            now = f"{f.stat().st_size:,} bytes now" if f.exists() else "gone now"
            raise ModelError(
                f"{f} changed while the export read it ({self.weight_stats[f][0]:,} bytes when opened, {now}"
                f"{f' and {len(changed) - 1} more file(s)' if len(changed) > 1 else ''}): the program would mix two "
                "versions of the weights, so nothing was kept. Export again once the checkpoint is complete and "
                "nothing writes to it.")


def _stat(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{path}: cannot be read as JSON ({e}). Re-download or re-save the checkpoint.") from e


def weight_files_of(path: Path) -> list[Path]:
    """The safetensors files of the checkpoint folder ``path`` (its index's shards, else every *.safetensors but the
    weights of a PEFT adapter saved in the model's own folder: Granite Speech's, which models.lora reads)."""
    index = path / WEIGHTS_INDEX
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelError(f"{index}: has no 'weight_map'. Re-save the checkpoint with save_pretrained.")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise ModelError(
                f"{path}: shard(s) {', '.join(missing)} listed in {WEIGHTS_INDEX} are missing. "
                "Copy every shard of the checkpoint into the directory."
            )
        return files
    files = sorted(p for p in path.glob("*.safetensors") if p.name != ADAPTER_WEIGHTS_FILE)
    if not files:
        found = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        hint = (
            f" It holds {', '.join(found)}: pickle checkpoints are not read; convert them with "
            "`transformers` (from_pretrained(...).save_pretrained(dir, safe_serialization=True))."
            if found
            else ""
        )
        raise ModelError(f"{path}: no *.safetensors weights found.{hint}")
    return files


def stored_elements(files: list[Path]) -> int:
    """How many elements the safetensors ``files`` hold, from their headers: no tensor is read."""
    from safetensors import SafetensorError, safe_open

    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                for name in fh.keys():
                    total += math.prod(fh.get_slice(name).get_shape())
        except SafetensorError as e:
            raise ModelError(f"{file}: damaged or truncated safetensors file ({e}). Re-download it.") from e
    return total


def open_checkpoint(path: str | Path, *, need_weights: bool = True) -> Checkpoint:
    """Check a checkpoint directory and read its configs (not its weights)."""
    from transformers import AutoConfig

    from models.gguf import gguf_checkpoint, gguf_record, is_gguf

    path = Path(path).expanduser()
    if is_gguf(path):
        path = gguf_checkpoint(path)
    elif is_ctranslate2(path):
        path = whisper_checkpoint(path)
    if not path.is_dir():
        raise ModelError(
            f"checkpoint {path} does not exist or is neither a directory nor a GGUF file. Give a Hugging Face "
            "checkpoint directory with model.checkpoint=/path/to/dir (config.json, *.safetensors, tokenizer.json) "
            "or a GGUF file with model.checkpoint=/path/to/model.gguf."
        )
    if not (path / "config.json").exists():
        raise ModelError(f"{path}: config.json is missing; a Hugging Face checkpoint directory needs one.")
    try:
        hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a bad config
        raise ModelError(f"{path / 'config.json'}: not a valid Hugging Face config ({e}).") from e

    gen_file = path / "generation_config.json"
    gen = _read_json(gen_file) if gen_file.exists() else {}
    bos = gen.get("bos_token_id", getattr(hf_config, "bos_token_id", None))
    eos = _as_id_list(gen.get("eos_token_id", getattr(hf_config, "eos_token_id", None)))
    return Checkpoint(
        path=path,
        hf_config=hf_config,
        weight_files=weight_files_of(path) if need_weights else [],
        tokenizer_files=[path / n for n in TOKENIZER_SIDE_FILES if (path / n).exists()],
        generation_config_file=gen_file if gen_file.exists() else None,
        bos_id=None if bos is None else int(bos),
        eos_ids=eos,
        converted_from=gguf_record(path) or ct2_record(path),
    )


# Random weights are made as a published checkpoint stores them, in bf16: half the memory of fp32 until quantize
# casts each layer to quant.dtype as it reaches it, so an 8B shape is never whole in fp32 (32 GB).
RANDOM_INIT_DTYPE = torch.bfloat16


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Within this block, new floating-point tensors (and modules' parameters) are ``dtype``."""
    kept = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(kept)


def build_model(ckpt: Checkpoint, max_context_len: int, *, family: str | None = None, random_init: bool = False,
                seed: int = 0, attention: str = "aten", kv_dtype: str = "fp32", attention_sink: int = 0,
                call_tokens: int | None = None, keeps_final_hidden: bool = False, device: str = "cpu") -> CausalLM:
    """The decoder for ``ckpt``'s architecture, with its weights in their stored dtype (or seeded random ones in bf16);
    on ``device="meta"``, its shapes alone (nothing read or allocated).

    ``attention="custom_ops"`` is a preference: a model whose attention the ExecuTorch kernel cannot
    compute (soft-capping, sliding windows shorter than the context) gets the ATen attention, and the
    choice is logged and visible in ``model.args.attention``. ``kv_dtype`` (``models.decoder.KV_CACHES``) other
    than fp32 needs those kernels, and is refused for such a model. ``attention_sink`` and ``call_tokens`` shape the
    caches (``models.kv_cache.CacheGeometry``). ``keeps_final_hidden``: each position's final hidden state kept, for
    Gemma 4's assistant (``models.gemma4_drafter``).
    """
    args = decoder_args(ckpt.hf_config, max_context_len, source=str(ckpt.path / "config.json"), family=family)
    blockers = args.custom_ops_blockers()
    if kv_dtype != "fp32" and (attention != "custom_ops" or blockers):
        why = (f"this model needs ATen attention (llama::custom_sdpa cannot compute {', '.join(blockers)})" if blockers
               else "this backend uses ATen attention")
        raise ModelError(f"export.kv_dtype={kv_dtype}: a quantized KV cache is read by ExecuTorch's "
                         f"llama::custom_quantized_sdpa kernel, but {why}. Use export.kv_dtype=fp32, or a backend "
                         "with attention: custom_ops (xnnpack, portable) and a model the kernel can compute.")
    if attention == "custom_ops" and blockers:
        if device != "meta":
            log.info("attention: aten, because llama::custom_sdpa cannot compute %s", ", ".join(blockers))
        attention = "aten"
    try:
        args = dataclasses.replace(args, attention=attention, kv_dtype=kv_dtype, attention_sink=attention_sink,
                                   call_tokens=call_tokens, keeps_final_hidden=keeps_final_hidden)
    except ValueError as e:
        raise ModelError(f"{ckpt.path}: {e}") from e
    if device == "meta" or not random_init:
        with torch.device("meta"), default_dtype(RANDOM_INIT_DTYPE if random_init else torch.float32):
            model = CausalLM(args)
        if device == "meta":
            return model
        load_weights(model, ckpt.weight_files, rename=tensor_namer(ckpt.hf_config))
        model.init_buffers()
        return model.eval()
    torch.manual_seed(seed)
    with default_dtype(RANDOM_INIT_DTYPE):
        model = CausalLM(args)
    model.init_buffers()
    return model.eval()


def stored_bytes(ckpt: Checkpoint, model: CausalLM) -> int:
    """Bytes the weights take as loaded: the safetensors files' sizes; for random weights (no files), ``model``'s
    parameters in the dtype they are made in."""
    if ckpt.weight_files:
        return sum(f.stat().st_size for f in ckpt.weight_files)
    return model.parameter_count() * RANDOM_INIT_DTYPE.itemsize


def load_weights(model: CausalLM, files: list[Path], rename: Callable[[str], str | None] = lambda name: name,
                 integers: frozenset[str] = frozenset()) -> None:
    """Stream tensors file by file into a meta-device model, checking names and shapes. ``rename``: the model's name
    for a checkpoint tensor, None for one another component reads (a vision-language checkpoint's vision tower);
    ``integers``: the model's integer tensors (an index, such as Gemma 4's assistant's token order)."""
    tied = model.args.tie_word_embeddings
    expected = {name: tuple(p.shape) for name, p in model.state_dict(keep_vars=True).items()
                if not (tied and name == "lm_head.weight")}  # shared with the embedding
    loaded = read_tensors(files, expected, rename, skip=lambda name: name.endswith(IGNORED_TENSOR_SUFFIXES)
                          or (tied and name == "lm_head.weight"), integers=integers)
    model.load_state_dict(loaded, strict=False, assign=True)
    if tied:
        model.tie_weights()


def read_tensors(files: list[Path], expected: dict[str, tuple[int, ...]], rename: Callable[[str], str | None],
                 skip: Callable[[str], bool] = lambda name: False,
                 integers: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of ``files`` under ``rename``'s names, each of ``expected``'s shape, every expected one present
    and no other (``rename`` None: another component's tensor; ``skip``: recomputed ones), finite; read lazily, so
    only these tensors are read."""
    from safetensors import SafetensorError, safe_open

    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", backend="mmap") as fh:
                for stored in fh.keys():
                    name = rename(stored)
                    if name is None or skip(name):
                        continue
                    if name not in expected:
                        unexpected.append(stored)
                        continue
                    tensor = fh.get_tensor(stored)
                    if tuple(tensor.shape) != expected[name]:
                        raise ModelError(
                            f"{file}: tensor {stored} has shape {tuple(tensor.shape)}, but config.json implies "
                            f"{expected[name]}. The weights and config.json come from different models."
                        )
                    if tensor.is_floating_point() == (name in integers):
                        if name in integers:
                            raise ModelError(f"{file}: tensor {stored} is {tensor.dtype}, where an integer index is "
                                             "expected. The checkpoint is damaged or of another architecture.")
                        raise ModelError(
                            f"{file}: tensor {stored} is {tensor.dtype}; this loader reads floating-point weights. "
                            "Pre-quantized checkpoints (GPTQ, AWQ, bitsandbytes) are not supported: export from the "
                            "original bf16/fp16/fp32 checkpoint and pick a quant option instead."
                        )
                    loaded[name] = tensor
        except SafetensorError as e:
            raise ModelError(f"{file}: damaged or truncated safetensors file ({e}). Re-download it.") from e
    missing = sorted(n for n in expected if n not in loaded)
    if missing:
        raise ModelError(
            f"{files[0].parent}: tensor(s) missing from the safetensors files: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete or of another architecture."
        )
    if unexpected:
        raise ModelError(
            f"{files[0].parent}: tensor(s) this architecture does not use: {', '.join(sorted(unexpected)[:8])}. "
            "config.json's architecture does not match the weights."
        )
    check_finite(loaded, files[0].parent)
    return loaded


# Elements checked at once: the check's temporary is this many bytes, however large the tensor.
FINITE_CHUNK = 1 << 24


def check_finite(tensors: dict[str, torch.Tensor], where: Path) -> None:
    """NaN or infinite weights named by tensor before anything is computed from them (quantizing them would hide
    where they were, and validation would only see an infinite perplexity)."""
    bad = {}
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        count = sum(int((~torch.isfinite(flat[i:i + FINITE_CHUNK])).sum())
                    for i in range(0, flat.numel(), FINITE_CHUNK))
        if count:
            bad[name] = count
    if bad:
        listed = ", ".join(f"{name} ({count:,} of {tensors[name].numel():,} values)" for name, count in
                           list(bad.items())[:4])
        raise ModelError(
            f"{where}: NaN or infinite weights in {len(bad)} tensor(s): {listed}{' ...' if len(bad) > 4 else ''}. "
            "The checkpoint is damaged, or was saved after training diverged: download it again or export another "
            "checkpoint.")
