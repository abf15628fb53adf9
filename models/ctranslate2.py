"""CTranslate2 Whisper folders (faster-whisper's format) as a checkpoint source: read into a Hugging Face folder.

faster-whisper ships Whisper as CTranslate2 writes it: ``model.bin`` (a header, then named arrays with shape and
dtype, then aliases), beside its own ``config.json`` (suppressed tokens, language ids, alignment heads),
``tokenizer.json`` and ``vocabulary.txt``. The layout is CTranslate2's ``ModelSpec._serialize``
(``python/ctranslate2/specs/model_spec.py``, binary version 6): strings are a uint16 length (with the NUL) and the
bytes; each variable is its name, a uint8 rank, uint32 dimensions, a uint8 dtype, a uint32 byte count and the data.

:func:`whisper_checkpoint` reads the file with NumPy (memory-mapped, nothing imported from CTranslate2), renames the
arrays to transformers' ``WhisperForConditionalGeneration`` (CTranslate2 fuses q/k/v and the cross-attention's k/v,
and gives ``k_proj`` a bias of zeros, which transformers' Whisper does not have), and writes a Hugging Face folder
(config, generation config, float32 safetensors, tokenizer, feature extractor) under the cache, once per file
(keyed by path, size and mtime), renamed into place when complete. ``ct2_source.json`` in it records the source.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from models.errors import ModelError
from models.gguf import llm_exporters_cache, write_converted

log = logging.getLogger(__name__)

MODEL_FILE = "model.bin"
SOURCE_RECORD = "ct2_source.json"
BINARY_VERSION = 6  # the layout read here; CTranslate2 4.x writes it
WHISPER_SPEC = "WhisperSpec"
GELU = 3  # CTranslate2's ActivationType (RELU, GELUTanh, SWISH, GELU, ...): Whisper's exact GELU
# CTranslate2's DataType enum (include/ctranslate2/types.h): the float ones are read, the integer ones refused.
FLOAT_DTYPES = {0: np.float32, 4: np.float16}
DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16",
               6: "float8_e4m3", 7: "float8_e5m2"}
INT_DTYPES = {1: np.int8, 2: np.int16, 3: np.int32}
# Whisper's special tokens by name, as its tokenizer spells them (ids are read from tokenizer.json).
SPECIAL = {"start": "<|startoftranscript|>", "end": "<|endoftext|>", "transcribe": "<|transcribe|>",
           "translate": "<|translate|>", "no_timestamps": "<|notimestamps|>", "start_of_prev": "<|startofprev|>",
           "start_of_lm": "<|startoflm|>", "no_speech": "<|nospeech|>", "no_captions": "<|nocaptions|>"}


def is_ctranslate2(path: str | Path) -> bool:
    """A folder holding CTranslate2's ``model.bin`` (and no Hugging Face weights)."""
    path = Path(path).expanduser()
    return path.is_dir() and (path / MODEL_FILE).is_file() and not (path / "model.safetensors").exists()


@dataclass(frozen=True)
class Ct2Model:
    """What ``model.bin`` holds: the spec's name and revision, its arrays (memory-mapped) and aliases."""

    spec: str
    revision: int
    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    aliases: dict[str, str]

    def get(self, name: str) -> np.ndarray:
        return self.arrays[self.aliases.get(name, name)]

    def scalar(self, name: str) -> int:
        return int(self.get(name).reshape(()))


def read_model_bin(file: Path) -> Ct2Model:
    """Every array of a CTranslate2 ``model.bin``; a ModelError naming the problem for any other or damaged file."""
    size = file.stat().st_size
    data = np.memmap(file, dtype=np.uint8, mode="r")
    offset = 0

    def take(fmt: str) -> Any:
        nonlocal offset
        n = struct.calcsize(fmt)
        if offset + n > size:
            raise ModelError(f"{file}: ends after {size} bytes in the middle of its header: a truncated CTranslate2 "
                             "model. Join or download it again.")
        value = struct.unpack_from(fmt, data, offset)
        offset += n
        return value[0] if len(value) == 1 else value

    def string() -> str:
        nonlocal offset
        n = take("H")
        raw = bytes(data[offset:offset + n])
        offset += n
        return raw.rstrip(b"\0").decode("utf-8", errors="replace")

    version = take("I")
    if version != BINARY_VERSION:
        raise ModelError(f"{file}: not a CTranslate2 model of binary version {BINARY_VERSION} (it starts with version "
                         f"{version}). Give a folder faster-whisper or `ct2-transformers-converter` (CTranslate2 4.x) "
                         "wrote, or a Hugging Face Whisper folder.")
    spec, revision, count = string(), take("I"), take("I")
    arrays: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for _ in range(count):
        name = string()
        rank = take("B")
        shape = tuple(take("I") for _ in range(rank))
        dtype_id, nbytes = take("B"), take("I")
        if offset + nbytes > size:
            raise ModelError(f"{file}: array {name} runs past the end of the file ({size} bytes): a truncated "
                             "CTranslate2 model. Join or download it again.")
        dtypes[name] = DTYPE_NAMES.get(dtype_id, f"type {dtype_id}")
        numpy_dtype = FLOAT_DTYPES.get(dtype_id) or INT_DTYPES.get(dtype_id)
        if numpy_dtype is not None:
            arrays[name] = data[offset:offset + nbytes].view(numpy_dtype).reshape(shape)
        offset += nbytes
    aliases = {}
    for _ in range(take("I")):
        alias = string()
        aliases[alias] = string()
    return Ct2Model(spec, revision, arrays, dtypes, aliases)


def _cache_dir(path: Path) -> Path:
    st = (path / MODEL_FILE).stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return llm_exporters_cache() / "ctranslate2" / f"{path.name}-{key}"


def pending_conversion(path: str | Path) -> Path | None:
    """The CTranslate2 folder ``path`` when opening it converts it (not cached yet); None for anything else."""
    path = Path(path).expanduser()
    if not is_ctranslate2(path) or (_cache_dir(path) / SOURCE_RECORD).exists():
        return None
    return path


def whisper_checkpoint(path: str | Path) -> Path:
    """The Hugging Face Whisper folder for a CTranslate2 Whisper folder, converted on first use (cached)."""
    from filelock import FileLock

    path = Path(path).expanduser()
    target = _cache_dir(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f"{target.name}.lock")):  # two exports (test workers) convert it once
        return _converted(path, target)


def _converted(path: Path, target: Path) -> Path:
    if (target / SOURCE_RECORD).exists():
        log.info("CTranslate2 %s: using the converted checkpoint in %s", path, target)
        return target
    ct2 = read_model_bin(path / MODEL_FILE)
    check_whisper(ct2, path)
    log.info("CTranslate2 %s (%s, %s): converting into %s", path, ct2.spec,
             ct2.dtypes["decoder/embeddings/weight"], target)
    record = {"folder": str(path.resolve()), "spec": ct2.spec, "revision": ct2.revision,
              "stored_dtype": ct2.dtypes["decoder/embeddings/weight"], "converted_to": "float32",
              "size_bytes": (path / MODEL_FILE).stat().st_size}
    write_converted(target, lambda folder: _write_folder(ct2, path, folder), SOURCE_RECORD, record)
    return target


def ct2_record(folder: Path) -> dict[str, Any] | None:
    """What ``ct2_source.json`` says about a converted folder, or None for any other."""
    record = folder / SOURCE_RECORD
    return json.loads(record.read_text()) if record.is_file() else None


def check_whisper(ct2: Ct2Model, path: Path) -> None:
    """Refuse what this reader does not turn into transformers' Whisper exactly, each with the fix."""
    if ct2.spec != WHISPER_SPEC:
        raise ModelError(f"{path}: a CTranslate2 {ct2.spec} model; of CTranslate2's formats only Whisper "
                         f"({WHISPER_SPEC}) is read. Give that model's Hugging Face folder instead.")
    quantized = sorted({d for n, d in ct2.dtypes.items() if n.endswith("/weight") and d not in ("float32", "float16")})
    if quantized or any(n.endswith("weight_scale") for n in ct2.dtypes):
        raise ModelError(f"{path}: its weights are stored as {', '.join(quantized) or 'int8'} (CTranslate2's own "
                         "quantization), which would be exported as those rounded values. Convert the model again "
                         "with `ct2-transformers-converter --quantization float16` (or float32), or give its Hugging "
                         "Face folder.")
    flags = {name: ct2.scalar(f"decoder/{name}") for name in ("pre_norm", "scale_embeddings", "alibi",
                                                             "start_from_zero_embedding")
             if f"decoder/{name}" in ct2.arrays}
    if "decoder/activation" in ct2.arrays:
        flags["activation"] = ct2.scalar("decoder/activation")
    if flags.get("pre_norm", 1) != 1 or flags.get("activation", GELU) != GELU or any(
            flags.get(n, 0) for n in ("scale_embeddings", "alibi", "start_from_zero_embedding")):
        raise ModelError(f"{path}: a WhisperSpec with decoder options {flags}, which OpenAI's Whisper does not use; "
                         "give the model's Hugging Face folder.")
    for needed in ("config.json", "tokenizer.json"):
        if not (path / needed).is_file():
            raise ModelError(f"{path}: {needed} is missing beside model.bin (faster-whisper's folders have "
                             "config.json, tokenizer.json and vocabulary.txt). Copy the whole folder.")


def _layers(ct2: Ct2Model, stack: str) -> int:
    return len({n.split("/")[1] for n in ct2.arrays if re.fullmatch(r"layer_\d+", n.split("/")[1]) and
                n.startswith(f"{stack}/")})


def _split(array: np.ndarray, parts: int) -> list[np.ndarray]:
    return list(np.split(np.array(array, dtype=np.float32), parts, axis=0))


def _layout(layers: dict[str, int]) -> Iterator[tuple[str, str, str]]:
    """Every piece of Whisper as ``(role, transformers' name, CTranslate2's name)``, in both formats' terms: the
    one map the reader and the writer walk. Roles: ``table`` (one array), ``norm`` (weight/bias as gamma/beta),
    ``linear`` (weight, bias), ``qkv`` / ``kv`` (projections fused in one linear: q, k, v or k, v)."""
    for stack in ("encoder", "decoder"):
        prefix = f"model.{stack}"
        yield "table", f"{prefix}.embed_positions.weight", f"{stack}/position_encodings/encodings"
        yield "norm", f"{prefix}.layer_norm", f"{stack}/layer_norm"
        for i in range(layers[stack]):
            hf, ct = f"{prefix}.layers.{i}", f"{stack}/layer_{i}"
            yield "norm", f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm"
            yield "qkv", f"{hf}.self_attn", f"{ct}/self_attention/linear_0"
            yield "linear", f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1"
            if stack == "decoder":
                yield "norm", f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm"
                yield "linear", f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0"
                yield "kv", f"{hf}.encoder_attn", f"{ct}/attention/linear_1"
                yield "linear", f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2"
            yield "norm", f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm"
            yield "linear", f"{hf}.fc1", f"{ct}/ffn/linear_0"
            yield "linear", f"{hf}.fc2", f"{ct}/ffn/linear_1"
    for conv in ("conv1", "conv2"):
        yield "linear", f"model.encoder.{conv}", f"encoder/{conv}"
    yield "table", "model.decoder.embed_tokens.weight", "decoder/embeddings/weight"


FUSED = {"qkv": ("q", "k", "v"), "kv": ("k", "v")}
PAIRS = {"norm": (("weight", "gamma"), ("bias", "beta")), "linear": (("weight", "weight"), ("bias", "bias"))}


def state_dict(ct2: Ct2Model) -> dict[str, np.ndarray]:
    """transformers' ``WhisperForConditionalGeneration`` names for every array (float32); ``proj_out`` is tied."""
    out: dict[str, np.ndarray] = {}
    for role, hf, ct in _layout({stack: _layers(ct2, stack) for stack in ("encoder", "decoder")}):
        if role == "table":
            out[hf] = np.array(ct2.get(ct), dtype=np.float32)
        elif role in PAIRS:
            for hf_part, ct_part in PAIRS[role]:
                out[f"{hf}.{hf_part}"] = np.array(ct2.get(f"{ct}/{ct_part}"), dtype=np.float32)
        else:
            names = FUSED[role]
            weights, biases = _split(ct2.get(f"{ct}/weight"), len(names)), _split(ct2.get(f"{ct}/bias"), len(names))
            for n, w, b in zip(names, weights, biases):
                out[f"{hf}.{n}_proj.weight"] = w
                if n != "k":
                    out[f"{hf}.{n}_proj.bias"] = b
                elif np.any(b != 0):
                    raise ModelError("a WhisperSpec whose key projection has a bias: not OpenAI's Whisper. Give the "
                                     "model's Hugging Face folder.")
    return out


def _token_ids(tokenizer_file: Path) -> dict[str, int | None]:
    vocab = json.loads(tokenizer_file.read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    return {key: ids.get(token) for key, token in SPECIAL.items()}


def _write_folder(ct2: Ct2Model, source: Path, out: Path) -> None:
    """config.json, generation_config.json, model.safetensors, tokenizer and feature extractor files."""
    import torch
    from safetensors.torch import save_file
    from transformers import WhisperConfig, WhisperFeatureExtractor

    ct2_config = json.loads((source / "config.json").read_text())
    ids = _token_ids(source / "tokenizer.json")
    vocab, d_model = ct2.get("decoder/embeddings/weight").shape
    heads = {s: ct2.scalar(f"{s}/num_heads") for s in ("encoder", "decoder")}
    mel_bins = ct2.get("encoder/conv1/weight").shape[1]
    config = WhisperConfig(
        vocab_size=vocab, num_mel_bins=mel_bins, d_model=d_model,
        encoder_layers=_layers(ct2, "encoder"), decoder_layers=_layers(ct2, "decoder"),
        encoder_attention_heads=heads["encoder"], decoder_attention_heads=heads["decoder"],
        encoder_ffn_dim=ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0],
        decoder_ffn_dim=ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0],
        max_source_positions=ct2.get("encoder/position_encodings/encodings").shape[0],
        max_target_positions=ct2.get("decoder/position_encodings/encodings").shape[0],
        decoder_start_token_id=ids["start"], eos_token_id=ids["end"], bos_token_id=ids["end"], pad_token_id=ids["end"],
        tie_word_embeddings=True, architectures=["WhisperForConditionalGeneration"], dtype="float32")
    out.mkdir(parents=True)
    config.save_pretrained(str(out))
    tensors = {k: torch.from_numpy(v) for k, v in state_dict(ct2).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _generation_config(ct2_config, ids, source / "tokenizer.json", config).save_pretrained(str(out))
    WhisperFeatureExtractor(feature_size=mel_bins).save_pretrained(str(out))
    shutil.copy(source / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "WhisperTokenizer", "bos_token": SPECIAL["end"], "eos_token": SPECIAL["end"],
        "unk_token": SPECIAL["end"], "pad_token": SPECIAL["end"], "model_max_length": config.max_target_positions,
        "clean_up_tokenization_spaces": False}, indent=2) + "\n")


def _generation_config(ct2_config: dict[str, Any], ids: dict[str, int | None], tokenizer_file: Path,
                       config: Any) -> Any:
    """transformers' Whisper generation settings from faster-whisper's config.json and the tokenizer's tokens."""
    from transformers import GenerationConfig

    vocab = {t["id"]: t["content"] for t in json.loads(tokenizer_file.read_text()).get("added_tokens", [])}
    lang_ids = ct2_config.get("lang_ids") or []
    return GenerationConfig(
        decoder_start_token_id=ids["start"], eos_token_id=ids["end"], bos_token_id=ids["end"], pad_token_id=ids["end"],
        max_length=config.max_target_positions, suppress_tokens=list(ct2_config.get("suppress_ids") or []),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin") or []),
        alignment_heads=[list(h) for h in ct2_config.get("alignment_heads") or []],
        is_multilingual=bool(lang_ids), lang_to_id={vocab[i]: i for i in lang_ids if i in vocab},
        task_to_id={"transcribe": ids["transcribe"], "translate": ids["translate"]},
        no_timestamps_token_id=ids["no_timestamps"], prev_sot_token_id=ids["start_of_prev"],
        forced_decoder_ids=None)


# -- writing: the inverse of the reader, for checkpoints made in tests (models.tiny_whisper) -------------------------
NUMPY_DTYPE_IDS = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
                   np.dtype(np.float16): 4}


def write_model_bin(file: Path, arrays: dict[str, np.ndarray], aliases: dict[str, str], spec: str = WHISPER_SPEC,
                    revision: int = 3) -> None:
    """``arrays`` (name -> array) written as CTranslate2's ``ModelSpec._serialize`` does (binary version 6)."""

    def string(text: str) -> bytes:
        raw = text.encode("utf-8") + b"\0"
        return struct.pack("H", len(raw)) + raw

    with open(file, "wb") as out:
        out.write(struct.pack("I", BINARY_VERSION) + string(spec) + struct.pack("I", revision))
        out.write(struct.pack("I", len(arrays)))
        for name, array in sorted(arrays.items()):
            array = np.ascontiguousarray(array)
            out.write(string(name) + struct.pack("B", array.ndim) + b"".join(struct.pack("I", d) for d in array.shape))
            out.write(struct.pack("B", NUMPY_DTYPE_IDS[array.dtype]) + struct.pack("I", array.nbytes) + array.tobytes())
        out.write(struct.pack("I", len(aliases)))
        for alias, target in aliases.items():
            out.write(string(alias) + string(target))


def whisper_arrays(hf_state: dict[str, np.ndarray], heads: int, dtype: Any = np.float16) -> dict[str, np.ndarray]:
    """transformers' Whisper state dict in CTranslate2's names and fusions (the converter's layout)."""
    out: dict[str, np.ndarray] = {}
    layers = {stack: len({k.split(".")[3] for k in hf_state if k.startswith(f"model.{stack}.layers.")})
              for stack in ("encoder", "decoder")}
    for role, hf, ct in _layout(layers):
        if role == "table":
            out[ct] = np.asarray(hf_state[hf], dtype=dtype)
        elif role in PAIRS:
            for hf_part, ct_part in PAIRS[role]:
                out[f"{ct}/{ct_part}"] = np.asarray(hf_state[f"{hf}.{hf_part}"], dtype=dtype)
        else:  # the key projection has no bias: CTranslate2 stores zeros in its place
            names = FUSED[role]
            out[f"{ct}/weight"] = np.asarray(np.concatenate([hf_state[f"{hf}.{n}_proj.weight"] for n in names]), dtype)
            out[f"{ct}/bias"] = np.asarray(np.concatenate([
                hf_state[f"{hf}.{n}_proj.bias"] if n != "k" else np.zeros_like(hf_state[f"{hf}.v_proj.bias"])
                for n in names]), dtype)
    for stack in ("encoder", "decoder"):
        out[f"{stack}/num_heads"] = np.array(heads, dtype=np.int16)
    for flag, value in (("pre_norm", 1), ("scale_embeddings", 0), ("alibi", 0), ("start_from_zero_embedding", 0),
                        ("activation", GELU)):
        out[f"decoder/{flag}"] = np.array(value, dtype=np.int8)
    return out
