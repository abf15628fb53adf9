"""GGUF files (llama.cpp, Ollama) as a checkpoint source: dequantized by transformers into a Hugging Face folder.

transformers reads GGUF for the architectures it maps (``GGUF_SUPPORTED_ARCHITECTURES``) and
dequantizes every tensor to floating point; the folder it becomes is then exported like any other
checkpoint. Conversion is cached (keyed by the file's path, size and mtime), so a sweep over quant
options converts once. ``gguf_source.json`` in the folder records where the weights came from.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from models.errors import ModelError
from models.families import FAMILIES

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
SOURCE_RECORD = "gguf_source.json"


def is_gguf(path: str | Path) -> bool:
    """A file (not a directory) named ``*.gguf`` or starting with the GGUF magic bytes."""
    path = Path(path).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def llm_exporters_cache() -> Path:
    """The project's cache folder: ``$LLM_EXPORTERS_CACHE``, else ``$XDG_CACHE_HOME/llm-exporters`` (``~/.cache``):
    converted GGUF checkpoints, trained tiny checkpoints, the Qwen2.5-Coder pair."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llm-exporters"
    return Path(os.environ.get("LLM_EXPORTERS_CACHE", default))


def cache_root() -> Path:
    """Where converted GGUF checkpoints live."""
    return llm_exporters_cache() / "gguf"


def _families_by_model_type() -> dict[str, str]:
    return {f.model_type: name for name, f in FAMILIES.items()}


def supported_gguf_architectures() -> list[str]:
    """GGUF ``general.architecture`` values both transformers can read and our decoder implements."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    ours = _families_by_model_type()
    # gemma3 GGUFs become model_type gemma3_text, which is the family's model_type.
    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a in ours or f"{a}_text" in ours)


def read_header(path: Path) -> dict[str, Any]:
    """Architecture, quant type and tensor count of a GGUF file; a ModelError if it is not a whole GGUF file."""
    return _read(path.resolve(), *_stamp(path))[0]


def gguf_tensors(path: Path) -> "GgufTensors":
    """What the file's conversion dequantizes, from its header."""
    return _read(path.resolve(), *_stamp(path))[1]


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


# GGUF's value types (gguf.GGUFValueType) -> the struct format of one value; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
ALIGNMENT = "general.alignment"


class _Header:
    """GGUF's header, read front to back (version 2 and 3, little-endian): its key-value fields up to the tensor
    infos, each tensor's element count. gguf's own reader parses every field into arrays, the vocabulary's strings
    one by one (3.8 s for SmolLM2's 49K, 15 s for Qwen2.5's 151K); this skips what it is not asked for (0.2, 0.4 s)."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh

    def take(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = self.fh.read(size)
        if len(data) != size:
            raise EOFError("the file ends inside its header")
        return struct.unpack("<" + fmt, data)[0]

    def string(self) -> str:
        return self.fh.read(self.take("Q")).decode("utf-8", errors="replace")

    def value(self, kind: int, keep: bool) -> Any:
        if kind == _STRING:
            return self.string() if keep else self.fh.seek(self.take("Q"), 1)
        if kind == _ARRAY:
            inner, n = self.take("I"), self.take("Q")
            if inner in _SCALARS and not keep:
                return self.fh.seek(n * struct.calcsize("<" + _SCALARS[inner]), 1)
            return [self.value(inner, keep) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.take(_SCALARS[kind])

    def read(self, keys: set[str], file_bytes: int) -> tuple[dict[str, Any], list[int]]:
        """The fields named in ``keys`` and each tensor's element count; a ValueError for a tensor whose data lies
        past the end of the file (``file_bytes`` long: a truncated copy)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        version = self.take("I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader takes 2 and 3, little-endian)")
        tensors, kvs = self.take("Q"), self.take("Q")
        wanted, fields = keys | {ALIGNMENT}, {}
        for _ in range(kvs):
            key = self.string()
            value = self.value(self.take("I"), key in wanted)
            if key in wanted:
                fields[key] = value
        ends = []
        for _ in range(tensors):
            name = self.string()
            dims = [self.take("Q") for _ in range(self.take("I"))]
            kind, offset = self.take("I"), self.take("Q")
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            ends.append((name, math.prod(dims), offset + math.prod(dims) // block * block_bytes))
        alignment = int(fields.get(ALIGNMENT, 32))
        start = -(-self.fh.tell() // alignment) * alignment  # the tensors' data, aligned after the infos
        for name, _, end in ends:
            if start + end > file_bytes:
                raise ValueError(f"tensor {name}'s data ends at byte {start + end}, past the file's end")
        return fields, [n for _, n, _ in ends]


@functools.lru_cache(maxsize=4)
def _read(path: Path, size: int, mtime_ns: int) -> tuple[dict[str, Any], "GgufTensors"]:
    """The header's facts, read once per file and process."""
    import gguf

    with open(path, "rb") as fh:
        magic = fh.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(
                f"{path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}). Give a .gguf "
                "file from llama.cpp / Ollama, or a Hugging Face checkpoint directory."
            )
        try:
            fields, sizes = _Header(fh).read({"general.architecture", "general.file_type"}, size)
            architecture = str(fields["general.architecture"])
        except (ValueError, KeyError, EOFError, OSError, OverflowError, MemoryError) as e:
            raise ModelError(
                f"{path}: damaged or truncated GGUF file ({type(e).__name__}: {e}). Download or copy it again "
                f"(its size is {size} bytes)."
            ) from e
    file_type = fields.get("general.file_type")
    quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else "unknown"
    header = {"file": str(path), "architecture": architecture, "quant_type": quant, "tensors": len(sizes),
              "size_bytes": size, "dequantized_to": "float32"}
    return header, GgufTensors(path, sum(sizes), max(sizes, default=0), size)


@dataclass(frozen=True)
class GgufTensors:
    """What a GGUF file's conversion holds, read from its header: every tensor dequantized to fp32."""

    file: Path
    parameters: int  # elements of every tensor the file stores (an lm_head stored beside a tied embedding included)
    largest: int  # elements of its largest tensor
    file_bytes: int


def pending_conversion(path: str | Path) -> GgufTensors | None:
    """The tensors of the GGUF file ``path`` when opening it will convert it (its converted folder is not cached
    yet); None for anything else. Read from the header alone (memory-mapped): no tensor data is touched."""
    path = Path(path).expanduser()
    if not is_gguf(path) or (_cache_dir(path) / SOURCE_RECORD).exists():
        return None
    return gguf_tensors(path)


def _cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{key}"


def gguf_checkpoint(path: str | Path, out_dir: Path | None = None) -> Path:
    """The Hugging Face checkpoint folder for a GGUF file, converting it on first use.

    The folder is written under a temporary name and renamed when complete, so an interrupted
    conversion never looks finished.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise ModelError(f"GGUF file {path} does not exist. Give the path of a .gguf file with model.checkpoint=...")
    target = out_dir or _cache_dir(path)  # keyed by the file's path, size and mtime: checked when it was converted
    if (target / SOURCE_RECORD).exists():
        log.info("GGUF %s: using the converted checkpoint in %s", path.name, target)
        return target
    header = read_header(path)
    supported = supported_gguf_architectures()
    if header["architecture"] not in supported:
        raise ModelError(
            f"{path}: GGUF architecture {header['architecture']!r} is not supported. Supported GGUF architectures: "
            f"{', '.join(supported)}. Export from the model's Hugging Face checkpoint instead if its family is "
            "supported there (python -m exporters.llm --help lists the model options)."
        )
    log.info("GGUF %s (%s, %s): dequantizing with transformers into %s", path.name, header["architecture"],
             header["quant_type"], target)
    write_converted(target, lambda folder: _convert(path, folder), SOURCE_RECORD, header)
    return target


def write_converted(target: Path, write: Callable[[Path], None], record_name: str, record: dict[str, Any]) -> None:
    """A converted checkpoint folder: ``write(folder)`` into a temporary folder beside ``target``, ``record`` (where
    the weights came from) as ``record_name`` in it, then renamed into place whole, so an interrupted conversion never
    looks finished (GGUF files here, CTranslate2 folders in ``models.ctranslate2``)."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        (tmp / record_name).write_text(json.dumps(record, indent=2) + "\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert(path: Path, out: Path) -> None:
    """transformers dequantizes; a fresh model built from the config is saved (a GGUF-loaded one refuses to be)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(path.parent), path.name
    try:
        with gguf_metadata_read_once():
            loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    except (ValueError, KeyError, OSError, RuntimeError) as e:
        raise ModelError(f"{path}: transformers could not read this GGUF file ({e}).") from e
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):  # shapes only: it takes the loaded tensors themselves, so one fp32 model is held, not two
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict(), assign=True)
    fresh.tie_weights()
    del loaded
    fresh.generation_config = _generation_config(fresh.generation_config, tokenizer)
    fresh.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


@contextlib.contextmanager
def gguf_metadata_read_once() -> Iterator[None]:
    """Within this block, each GGUF file's metadata is parsed once. transformers 5.23.0 reads the file anew for the
    model's config, its weights and the tokenizer's config (``load_gguf_checkpoint``, a ``gguf.GGUFReader`` each), and
    the reader parses every metadata value element by element: SmolLM2's 49,152 tokens and 48,900 merges took about 4
    s per read here: a 2-layer cut converts in 21 s instead of 29-36. The reader is kept per file (it only reads, through
    a read-only memory map) and the metadata-only result handed out as a copy (callers pop from it)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    stock_reader, stock_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    readers: dict[tuple[str, str], Any] = {}
    metadata: dict[str, Any] = {}

    def reader(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = stock_reader(path, mode)
        return readers[key]

    def load(path: str, return_tensors: bool = False, **kwargs: Any) -> Any:
        if return_tensors or kwargs:
            return stock_load(path, return_tensors, **kwargs)
        key = os.path.realpath(path)
        if key not in metadata:
            metadata[key] = stock_load(path, False)
        return copy.deepcopy(metadata[key])

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = reader, load  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = stock_reader, stock_load  # type: ignore[misc]


def _generation_config(gen: Any, tokenizer: Any) -> Any:
    """bos/eos from the tokenizer when the GGUF metadata left them out of the generation config."""
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
    if gen.eos_token_id is None and tokenizer.eos_token_id is not None:
        gen.eos_token_id = tokenizer.eos_token_id
    return gen


def gguf_record(checkpoint_dir: Path) -> dict[str, Any] | None:
    """What ``gguf_source.json`` says about a converted folder, or None for an ordinary checkpoint."""
    record = checkpoint_dir / SOURCE_RECORD
    return json.loads(record.read_text()) if record.is_file() else None
