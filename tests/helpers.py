"""Helpers the tests share (fixtures are in conftest.py): real Hydra composition, parity checks, checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from exporters.context.artifacts import ExportResult
from exporters.config import CONF_DIR, compose

REPO_ROOT = Path(__file__).resolve().parent.parent
# Decoder layers of SmolLM2-135M kept in the real model the quant/backend tests export.
REAL_LAYERS = 2


# The vision-language programs under test: the MultimodalRunner's three methods and one text method (decode_one_token,
# the fewest graphs to lower: the suite's time), named as apps that share memory arenas name them.
VLM_PROGRAM = ("export.methods=[decode]", "export.layout=split", "export.max_seq_len=32")
# Gemma 4's is its program of every modality (models.tiny_alm's checkpoint: image and audio towers) with its assistant
# (draft_propose beside verify), one export for four tests: the stock runner drives its images
# (tests/test_vision_language.py) and its recordings (tests/test_gemma4_audio.py), tests/test_gemma4_drafter.py
# speculates with it on image prompts, tests/test_serve.py chats with it. One text_decoder call takes up to 191
# positions: a recording of 7.64 s.
GEMMA4_PROGRAM = ("export.methods=[decode]", "export.layout=split", "export.max_seq_len=192")
VLM_ASSISTANT_TOKENS = 2


def vlm_program_overrides(family: str, ckpt: Path, gemma4_assistant: Callable[[Path], Path]) -> list[str]:
    """The export of ``family``'s tiny vision-language checkpoint ``ckpt`` that the runner test drives (for Gemma 4,
    ``ckpt`` is the checkpoint of every modality: :func:`gemma4_program_overrides`)."""
    if family == "gemma4":
        return gemma4_program_overrides(ckpt, gemma4_assistant)
    return ["model=hf", f"model.checkpoint={ckpt}", *VLM_PROGRAM]


def gemma4_program_overrides(ckpt: Path, gemma4_assistant: Callable[[Path], Path]) -> list[str]:
    """Gemma 4's program of every modality with its assistant, from the tiny checkpoint ``ckpt`` of every modality."""
    return ["model=hf", f"model.checkpoint={ckpt}", *GEMMA4_PROGRAM, f"draft.checkpoint={gemma4_assistant(ckpt)}",
            f"draft.tokens={VLM_ASSISTANT_TOKENS}"]


def compose_config(*overrides: str) -> DictConfig:
    """Compose the real conf/ tree exactly as the CLI does, without Hydra parsing pytest's argv."""
    return compose(*overrides)


def assert_matches_transformers(ref, ours, tokens: torch.Tensor, prefill_len: int, atol: float = 1e-4) -> None:  # type: ignore[no-untyped-def]
    """Our decoder on ``tokens[:, :prefill_len]`` then one token per step, against ``ref``'s logits for the
    whole sequence: the KV cache must carry the prefix exactly."""
    with torch.no_grad():
        expected = ref(tokens).logits
        got = ours(tokens[:, :prefill_len], torch.tensor([0]), full_logits=True)
        torch.testing.assert_close(got, expected[:, :prefill_len], atol=atol, rtol=0, msg=lambda m: f"prefill: {m}")
        for pos in range(prefill_len, tokens.shape[1]):
            step = ours(tokens[:, pos:pos + 1], torch.tensor([pos]))
            torch.testing.assert_close(step, expected[:, pos], atol=atol, rtol=0,
                                       msg=lambda m, pos=pos: f"decode step at position {pos}: {m}")


def assert_every_split_matches(ours, calls_by_split: dict[str, list[torch.Tensor]], expected: torch.Tensor,  # type: ignore[no-untyped-def]
                               atol: float = 1e-5) -> None:
    """For each way a prompt's embeddings are split into calls (name -> the calls, in order), our decoder's logits of
    every position, call after call from an empty cache, equal ``expected`` [T, V] (transformers' one forward)."""
    for how, calls in calls_by_split.items():
        ours.reset_cache()
        logits, start = [], 0
        for call in calls:
            logits.append(ours(call, torch.tensor([start]), True)[0])
            start += call.shape[1]
        torch.testing.assert_close(torch.cat(logits), expected, atol=atol, rtol=0, msg=how)


def sized_run(ckpt: Path, run: Path, *overrides: str) -> Any:
    """The vision geometry the plan of ``ckpt`` with ``overrides`` decides (model.image_size), and ``run`` made as an
    export leaves it: the processor files sized to that square, the tokenizer beside them."""
    from exporters.components.resolve import plan_export
    from exporters.components.vision import processor_files_sized

    geometry = plan_export(compose_config("model=hf", f"model.checkpoint={ckpt}", *overrides)).component(
        "vision").build.geometry
    run.mkdir()
    for final, staged in processor_files_sized(ckpt, geometry, run).items():
        staged.rename(final)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ckpt / name, run)
    return geometry


def stock_runner_text(pte: Path, inputs: list, new_tokens: int) -> str:  # type: ignore[type-arg]
    """What ExecuTorch's stock MultimodalRunner writes greedily for ``inputs`` (its ``make_*_input``s), with the
    tokenizer beside the program; a new runner each call (one keeps its position across calls: a conversation)."""
    from executorch.extension.llm.runner import GenerationConfig, MultimodalRunner

    runner = MultimodalRunner(str(pte), str(pte.parent / "tokenizer.json"))
    pieces: list[str] = []
    runner.generate(inputs, GenerationConfig(max_new_tokens=new_tokens, temperature=0.0, echo=False),
                    token_callback=pieces.append)
    return "".join(pieces)


def transformers_model(ckpt: Path):  # type: ignore[no-untyped-def]
    """The checkpoint as transformers loads it, by its config's architecture (fp32, eager attention): the reference a
    multimodal program is compared with."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(ckpt)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()


def copy_checkpoint(src: Path, dst: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A copy of checkpoint ``src`` at ``dst`` with ``config.json`` fields set (``config``) or removed (``drop``)."""
    shutil.copytree(src, dst)
    if config or drop:
        path = dst / "config.json"
        cfg = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
        path.write_text(json.dumps({**cfg, **(config or {})}))
    return dst


def eager_model_of(result: ExportResult):  # type: ignore[no-untyped-def]
    """Rebuild, independently of the pipeline, the eager model an export must match (same quantization)."""
    from omegaconf import OmegaConf

    from exporters.config import QuantConfig
    from exporters.quant.apply import quantize_model
    from exporters.quant.calibration import CalibrationText, calibration_text
    from models.checkpoint import build_model, open_checkpoint

    cfg = result.manifest.config
    ex = cfg["export"]
    model = build_model(open_checkpoint(result.manifest.model.checkpoint),
                        ex.get("max_context_len") or ex["max_seq_len"], attention=result.manifest.model.attention,
                        kv_dtype=ex.get("kv_dtype", "fp32"), attention_sink=ex.get("attention_sink", 0),
                        call_tokens=result.manifest.kv_cache.tokens_per_call if result.manifest.kv_cache else None)
    quant = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(QuantConfig), cfg["quant"]))
    assert isinstance(quant, QuantConfig)
    checkpoint = open_checkpoint(result.manifest.model.checkpoint)

    def calibration() -> CalibrationText:  # a calibrated algorithm or size budget reads the same text again
        return calibration_text(quant.calibration, None, checkpoint, model.args.vocab_size, model.args.max_context_len)

    quantize_model(model, quant, calibration=calibration)
    return model


def write_gguf(checkpoint: Path, out: Path, arch: str, metadata: dict[str, Any]) -> Path:
    """``checkpoint`` (a Hugging Face folder with a byte-level BPE tokenizer.json) as a GGUF file, named and laid out
    by gguf-py's own tables as llama.cpp's converter names them: matrices in Q8_0, the rest in F32. ``metadata``: the
    ``<arch>.*`` keys. What a user's ``.gguf`` of a family looks like, in seconds."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    weights = load_file(checkpoint / "model.safetensors")
    blocks = 1 + max(int(n.split(".")[2]) for n in weights if n.startswith("model.layers."))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), blocks)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value in metadata.items():
        writer.add_key_value(f"{arch}.{key}", value, gguf.GGUFValueType.get_type(value),
                             sub_type=gguf.GGUFValueType.INT32 if isinstance(value, list) else None)
    vocab = gguf.vocab.BpeVocab(checkpoint)
    tokens = list(vocab.all_tokens())
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_token_list([t for t, _, _ in tokens])
    writer.add_token_types([kind for _, _, kind in tokens])
    gguf.SpecialVocab(checkpoint, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer)
    for name, tensor in weights.items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no name for {name}"
        data = tensor.float().squeeze(1).numpy() if tensor.dim() == 3 else tensor.float().numpy()  # conv [C, 1, K]
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
