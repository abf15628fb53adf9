"""The vision component: a vision-language checkpoint's image encoder beside its text decoder, in one program.

A checkpoint whose ``config.json`` names a vision-language architecture (``models.vision``) gets a component
``vision`` with one method, ``vision_encoder`` (one image of the processor's normalized pixels ``[1, 3, S, S]`` to
``[1, N, hidden]`` embeddings), and the decoder gets ``token_embedding`` and ``text_decoder``: the three methods
ExecuTorch's ``MultimodalRunner`` calls, which feeds each text segment and each image to ``text_decoder`` in one
call. The plan reads ``config.json`` (not the weights) to size the method; load reads the encoder with
transformers' own loader (``models.vision_encoder``); ``quant.vision`` quantizes it on its own.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from exporters.config import ExportConfig, ModelConfig, Source
from exporters.errors import UserError, check_choice
from exporters.plan.component import Component, ComponentKind, QuantPlan
from exporters.plan.lengths import Lengths
from exporters.program.methods import MULTIMODAL_METHODS, MethodSpec, MethodTable
from models.vision import PROCESSOR_FILES, load_processor, processor_settings

if TYPE_CHECKING:
    from exporters.footprint import Footprint
    from exporters.manifest import VisionCheck, VisionEntry
    from models.checkpoint import Checkpoint
    from models.vision_encoder import VisionEncoder

log = logging.getLogger("exporters")

VISION = "vision"  # the component's name (its buffers' prefix)
VISION_METHOD = "vision_encoder"  # the method ExecuTorch's MultimodalRunner calls for an image
# quant.vision: fp32; fp16 (computed in half precision, its output cast back to the text decoder's dtype); 8da8w
# (int8 weights per channel, int8 activations per token at run time); 8da4w (int4 weights in groups of
# quant.group_size, int8 activations per token).
VISION_SCHEMES = ("fp32", "fp16", "8da8w", "8da4w")
# quant.vision=auto: the scheme beside a decoder whose linear layers are quantized (chosen by measurement:
# docs/vision.md), and beside a float one.
AUTO, AUTO_QUANTIZED, AUTO_FLOAT = "auto", "8da8w", "fp32"
# Our constant methods beside the runner's: what an app needs to turn a picture into the method's input.
IMAGE_SIZE, IMAGE_TOKENS, IMAGE_TOKEN_ID = "get_image_size", "get_image_tokens", "get_image_token_id"


@dataclass(frozen=True)
class VisionGeometry:
    """What the plan knows of the vision encoder from ``config.json`` alone."""

    family: str  # models.vision.VisionLanguage.name
    image_size: int  # S: every image is resized to S x S by the processor
    tokens: int  # N: embedding positions per image in the text decoder
    image_token_id: int  # the token each image position takes in a prompt (the config's)


def vision_geometry(model: ModelConfig) -> VisionGeometry | None:
    """The vision encoder ``model.checkpoint`` holds (with ``model.random_init``, of its shape), from its
    ``config.json``; None for a text checkpoint (or a GGUF file, a tiny model: text only)."""
    if model.source != Source.hf or model.checkpoint is None:
        return None
    path = Path(model.checkpoint).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError):
        return None  # open_checkpoint reports it, with the fix
    from models.vision import VISION_LANGUAGE, geometry_of, vision_language_of

    if not any(arch in v.architectures for v in VISION_LANGUAGE for arch in architectures):
        return None
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    family = vision_language_of(hf_config)
    if family is None or family.geometry is None or getattr(hf_config, "vision_config", None) is None:
        return None  # text only (models.vision.text_only), or an incomplete config: load names what is missing
    size, tokens = geometry_of(hf_config, path)
    return VisionGeometry(family.name, size, tokens, family.image_token_id(hf_config))


def vision_spec(geometry: VisionGeometry) -> MethodSpec:
    return MethodSpec(VISION_METHOD, geometry.tokens, geometry.tokens, False, takes="pixels", gives="embeddings",
                      image_size=geometry.image_size)


def with_multimodal(kinds: list[str], geometry: VisionGeometry | None) -> list[str]:
    """The decoder's method kinds: ``export.methods``, and the text methods the MultimodalRunner calls when the
    checkpoint sees images."""
    return [*kinds, *(m for m in MULTIMODAL_METHODS if geometry is not None and m not in kinds)]


def vision_scheme(quant: Any) -> str:
    """The scheme ``quant.vision`` gives the vision encoder (``auto`` resolved by the decoder's linear scheme)."""
    if quant.vision != AUTO:
        return quant.vision
    return AUTO_QUANTIZED if quant.linear else AUTO_FLOAT


def check_vision(cfg: ExportConfig, lengths: Lengths, geometry: VisionGeometry | None,
                 dynamic_shapes: bool) -> None:
    """What a vision-language export cannot do, refused before any weight is read."""
    check_choice("quant.vision", cfg.quant.vision, [AUTO, *VISION_SCHEMES], "Fix quant.vision.")
    if geometry is None:
        if cfg.quant.vision != AUTO:
            raise UserError(f"quant.vision={cfg.quant.vision} quantizes a vision-language checkpoint's image encoder, "
                            "and model.checkpoint is a text model. Leave quant.vision unset.")
        return
    what = f"{cfg.model.checkpoint} sees images ({geometry.family}, {geometry.tokens} positions per image)"
    if not dynamic_shapes:
        raise UserError(f"{what}, and backend={cfg.backend.name} exports fixed-size calls: ExecuTorch's "
                        "MultimodalRunner feeds each text segment and each image to text_decoder in one call of its "
                        "own length. Use backend=xnnpack or backend=portable.")
    if geometry.tokens > lengths.call_tokens:
        raise UserError(f"{what}, and one call of text_decoder takes at most {lengths.call_tokens} tokens "
                        f"(export.max_seq_len): the MultimodalRunner feeds an image in one call. Set "
                        f"export.max_seq_len={geometry.tokens + 1} or more (and export.max_context_len above it).")
    for key, value, why in (
            ("quant.pt2e", cfg.quant.pt2e, "the backend's quantizer converts a graph that takes tokens"),
            ("draft.checkpoint", cfg.draft.checkpoint, "speculative decoding of image prompts is not built yet"),
            ("model.adapters", cfg.model.adapters or None, "adapters on a vision-language program are not built yet"),
            ("export.adapters", cfg.export.adapters if cfg.export.adapters != "methods" else None,
             "adapters on a vision-language program are not built yet")):
        if value is not None:
            raise UserError(f"{what}, and {key}={value}: {why}. Export it without {key}.")


def vision_component(cfg: ExportConfig, geometry: VisionGeometry | None, shortcuts: bool) -> Component | None:
    """The vision encoder as a component of the plan (None for a text checkpoint)."""
    if geometry is None:
        return None
    table = MethodTable({VISION_METHOD: vision_spec(geometry)}, {VISION_METHOD: None}, {}, {VISION_METHOD: VISION})
    return Component(name=VISION, kind=ComponentKind.vision_encoder, build=VisionBuild(cfg.model, geometry),
                     quant=QuantPlan(cfg.quant, cfg.export.tied_embedding, shortcuts), methods=table)


@dataclass(frozen=True)
class VisionBuild:
    """How the vision encoder is built: from the decoder's checkpoint folder, by transformers' own loader."""

    model: ModelConfig
    geometry: VisionGeometry

    @property
    def source(self) -> Source:
        return self.model.source

    def checkpoint(self, work_dir: Path) -> "Checkpoint":
        from models.checkpoint import open_checkpoint

        return open_checkpoint(self.model.checkpoint, need_weights=not self.model.random_init)

    def build(self, checkpoint: "Checkpoint", device: str = "cpu") -> "VisionEncoder":
        """The encoder with the checkpoint's weights, or with seeded random ones of its shape (model.random_init)."""
        from models.vision_encoder import load_vision_encoder, random_vision_encoder

        geometry = (self.geometry.image_size, self.geometry.tokens)  # the plan's, read from the files once
        if self.model.random_init:
            return random_vision_encoder(checkpoint.hf_config, self.model.seed, geometry)
        return load_vision_encoder(str(checkpoint.path), checkpoint.hf_config, geometry)


def quantize_vision(encoder: "VisionEncoder", scheme: str, group_size: int, out_dtype: torch.dtype) -> str:
    """``quant.vision`` applied to the encoder in place (its linear layers; the patch convolution and the norms stay
    in float); returns what was done, for the console and the manifest."""
    from torch import nn
    from torchao.quantization import quantize_

    from exporters.quant.schemes import LINEAR_SCHEMES, layer_scheme

    encoder.out_dtype = out_dtype
    if scheme == "fp32":
        return "fp32"
    if scheme == "fp16":
        encoder.to(torch.float16)
        encoder.compute_dtype = torch.float16
        return "fp16 (its output cast to the text decoder's dtype)"
    linears = [m for m in encoder.modules() if isinstance(m, nn.Linear)]
    requested = group_size if LINEAR_SCHEMES[scheme].bits == 4 else 0  # XNNPACK's 8-bit kernels: per channel
    by_choice: dict[tuple[str, int], set[int]] = {}  # one quantize_ walk per (scheme, group size) the layers get
    for layer in linears:
        by_choice.setdefault(layer_scheme(scheme, layer.in_features, requested), set()).add(id(layer))
    for (chosen, group), layers in by_choice.items():
        quantize_(encoder, LINEAR_SCHEMES[chosen].torchao_config(group, "hqq"),
                  filter_fn=lambda m, fqn, layers=layers: id(m) in layers)
    return f"{scheme} on its {len(linears)} linear layers"


# Peak RSS the vision encoder adds to an export, per byte of its fp32 weights: measured on SmolVLM-256M's shape
# (docs/vision.md; 3215 MB measured against 1819 MB estimated for the decoder alone, over 374 MB of fp32 encoder
# weights: the eager encoder, its captured and lowered graphs, the program's copy at validation).
VISION_PEAK_PER_BYTE = 3.7


def vision_footprint(parameters: int) -> "Footprint":
    """What the vision encoder adds to the export's memory, held from load to the end (exporters.footprint)."""
    from exporters.footprint import BASE_BYTES, Footprint

    fp32 = 4 * parameters
    return Footprint(parameters, fp32, fp32, fp32,
                     {stage: BASE_BYTES + int(VISION_PEAK_PER_BYTE * fp32) for stage in ("load", "quantize", "lower", "emit",
                                                                             "validate")})


def vision_constants(geometry: VisionGeometry) -> dict[str, Any]:
    return {IMAGE_SIZE: geometry.image_size, IMAGE_TOKENS: geometry.tokens, IMAGE_TOKEN_ID: geometry.image_token_id}


def noop_expands_dropped() -> Any:
    """A pass (after ``to_edge``, before partitioning) replacing each ``expand_copy`` to its input's own shape by its
    input. The eager attention of the vision towers (transformers' 4-D ``matmul``) traces to such expands, which
    XNNPACK does not take: each ended the layer's partition and copied its input on the portable kernels, one of
    them the ``[heads, P, P]`` attention probabilities (1 GB per layer at Gemma 3's 896 px)."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult

    expand = exir_ops.edge.aten.expand_copy.default

    class NoopExpandsDropped(ExportedProgramPassBase):
        def call(self, exported_program: Any) -> ExportedProgramPassResult:
            graph, dropped = exported_program.graph, 0
            for node in list(graph.nodes):
                if node.target == expand and tuple(node.args[0].meta["val"].shape) == tuple(node.meta["val"].shape):
                    node.replace_all_uses_with(node.args[0])
                    graph.erase_node(node)
                    dropped += 1
            exported_program.graph_module.recompile()
            return ExportedProgramPassResult(exported_program, dropped > 0)

    return NoopExpandsDropped()


def preprocessing(folder: Path) -> dict[str, Any]:
    """The processor's rescale factor, mean and std (and how it resizes), from its saved config: what an app does
    to a picture before vision_encoder."""
    settings = processor_settings(folder)
    return {key: settings[key] for key in ("rescale_factor", "image_mean", "image_std", "size", "resample",
                                           "do_image_splitting") if key in settings}


# Families whose processor writes patch rows (SigLIP2 NaFlex) where vision_encoder takes pixels: program_pixels.
PATCH_ROW_FAMILIES = ("lfm2_vl",)


def program_pixels(processed: Any, size: int) -> torch.Tensor:
    """The images of a processor's output as ``vision_encoder`` takes them, ``[n, 3, S, S]``. A NaFlex processor
    (LFM2-VL's SigLIP2) writes patch rows ``[n, P, 3 p^2]`` with each image's patch grid: one whole S x S image
    each is folded back into pixels; an image of any other grid cannot be fed to the program, and is refused."""
    pixels = processed["pixel_values"]
    if "spatial_shapes" not in processed:
        return pixels.reshape(-1, *pixels.shape[-3:])
    grids, mask = processed["spatial_shapes"].tolist(), processed["pixel_attention_mask"]
    patch = int(math.isqrt(pixels.shape[-1] // 3))
    side = size // patch
    for rows, cols in grids:
        if (rows, cols) != (side, side) or not bool(mask.all()):
            raise UserError(f"the processor made a {rows * patch}x{cols * patch} image and the program's vision_encoder "
                            f"takes {size}x{size} (get_image_size): the processor files beside the program are not "
                            "the ones it was exported with. Export again, or restore the run folder's processor files.")
    return (pixels.reshape(-1, side, side, patch, patch, 3).permute(0, 5, 1, 3, 2, 4)
            .reshape(-1, 3, size, size).contiguous())


def has_processor(folder: Path) -> bool:
    """A random-weight shape (config.json alone) has no processor."""
    return any((folder / name).is_file() for name in PROCESSOR_FILES)


def prompt_marker(processor: Any) -> str:
    """What a prompt writes where an image goes: Gemma 3's begin-of-image token, else the image token."""
    return getattr(processor, "boi_token", None) or processor.image_token


def vision_entry(component: Component, checkpoint: "Checkpoint", applied: str | None,
                 check: "VisionCheck | None") -> "VisionEntry":
    from exporters.manifest import VisionEntry
    from models.tokenizer import find_tokenizer

    geometry = component.build.geometry  # type: ignore[union-attr]
    tokenizer = find_tokenizer(checkpoint.path)
    token = None
    if tokenizer is not None and tokenizer.name == "tokenizer.json":
        from tokenizers import Tokenizer

        token = Tokenizer.from_file(str(tokenizer)).id_to_token(geometry.image_token_id)
    size = geometry.image_size
    return VisionEntry(family=geometry.family, image_size=size, tokens_per_image=geometry.tokens,
                       image_token_id=geometry.image_token_id, image_token=token,
                       prompt_marker=prompt_marker(load_processor(checkpoint.path)) if has_processor(checkpoint.path)
                       else None,
                       input=f"float32 [1, 3, {size}, {size}]: one RGB image, channels first, normalized",
                       preprocessing=preprocessing(checkpoint.path), quantization=applied or "fp32", check=check)
