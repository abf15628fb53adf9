"""The vision encoder: a vision-language checkpoint's image encoder beside its text decoder, in one program.

A checkpoint whose ``config.json`` names a vision-language architecture (``models.vision``) gets a component
``vision`` with one method, ``vision_encoder`` (one image of the processor's normalized pixels ``[1, 3, S, S]`` to
``[1, N, hidden]`` embeddings), and the decoder gets ``token_embedding`` and ``text_decoder``: the three methods
ExecuTorch's ``MultimodalRunner`` calls. The plan reads ``config.json`` (not the weights) to size the method; load
reads the tower and projector alone from the decoder's checkpoint folder (``models.vision_encoder``); ``quant.vision``
quantizes it apart (``exporters.quant.vision``); validation runs an image and an image prompt through the program
(``exporters.validation.image``). What the program holds of it: ``exporters.program.vision``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import Tokenizer
from transformers import AutoConfig

from exporters.components.kind import Basis, Bundled, Finalized, Kind, Part
from exporters.config import ExportConfig, ModelConfig, Source
from exporters.context.artifacts import summary
from exporters.errors import UserError, check_choice
from exporters.manifest import ComponentEntry, Manifest, VisionEntry
from exporters.output.files import private_path
from exporters.plan.component import Component, ComponentKind, FolderBuild, QuantPlan
from exporters.plan.footprint import Footprint, encoder_footprint
from exporters.program.methods import (MULTIMODAL_METHODS, MethodTable, check_encoder_unbuilt,
                                       check_runner_feeds)
from exporters.program.passes import noop_expands_dropped
from exporters.program.vision import (PATCH_ROW_FAMILIES, PROCESSOR_FILES, VISION, VISION_METHOD, VisionGeometry,
                                      has_processor, preprocessing, prompt_marker,
                                      vision_constants, vision_spec)
from exporters.quant.vision import AUTO, VISION_SCHEMES, quantize_vision, vision_scheme
from exporters.validation.encoder_prompt import EncoderBaseline
from exporters.validation.image import check_image_path, unquantized_image_path
from models.processor_files import saved_architectures
from models.tokenizer import find_tokenizer
from models.vision import VISION_LANGUAGE, geometry_of, load_processor, vision_language_of
from models.vision_encoder import load_vision_encoder, random_vision_encoder, vision_parameters

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.manifest import VisionCheck
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest
    from models.checkpoint import Checkpoint
    from models.vision_encoder import VisionEncoder

log = logging.getLogger("exporters")


@dataclass
class VisionRecord:
    """What the stages learn of the vision encoder."""

    checkpoint: Checkpoint  # the decoder's: the encoder is read from the same folder
    quantization: str | None = None  # quantize: what quant.vision did
    baseline: EncoderBaseline | None = None  # baseline: the image prompt through the unquantized models
    check: VisionCheck | None = None  # validate: the image path in the program against eager


def is_vision_language(model: ModelConfig) -> bool:
    """``model.checkpoint`` is a vision-language checkpoint (built or not)."""
    if model.source != Source.hf or model.checkpoint is None:
        return False
    archs = saved_architectures(Path(model.checkpoint).expanduser())
    return any(arch in v.architectures for v in VISION_LANGUAGE for arch in archs)


def vision_geometry(model: ModelConfig) -> VisionGeometry | None:
    """The vision encoder ``model.checkpoint`` holds (with ``model.random_init``, of its shape), from its
    ``config.json``; None for a text checkpoint (or a GGUF file, a tiny model: text only)."""
    if not is_vision_language(model):
        return None
    path = Path(str(model.checkpoint)).expanduser()
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    family = vision_language_of(hf_config)
    if family is None or family.geometry is None or getattr(hf_config, "vision_config", None) is None:
        return None  # text only (models.vision.text_only), or an incomplete config: load names what is missing
    geometry = geometry_of(hf_config, path, model.image_size)
    if geometry is None:
        return None  # its processor takes a range of sizes and model.image_size chose none: text only
    size, tokens = geometry
    return VisionGeometry(family.name, size, tokens, family.image_token_id(hf_config), family.size_chosen,
                          tuple(family.sized(size).items()) if family.size_chosen else (),
                          family.places_in_embedding)


@dataclass(frozen=True)
class VisionBuild(FolderBuild):
    """How the vision encoder is built: from the decoder's checkpoint folder, by transformers' own loader."""

    geometry: VisionGeometry

    def build(self, checkpoint: Checkpoint, device: str = "cpu") -> VisionEncoder:
        """The encoder with the checkpoint's weights, or with seeded random ones of its shape (model.random_init)."""
        geometry = (self.geometry.image_size, self.geometry.tokens)  # the plan's, read from the files once
        if self.model.random_init:
            return random_vision_encoder(checkpoint.hf_config, self.model.seed, geometry)
        return load_vision_encoder(str(checkpoint.path), checkpoint.hf_config, geometry)


# The largest whole number each half-precision dtype holds exactly (its significand): an M-RoPE image's channels
# (models.decoder.IMAGE_CHANNELS) travel in the decoder's activation dtype.
EXACT_INTEGERS = {"bf16": 256, "fp16": 2048}


class Vision(Kind):
    name = str(ComponentKind.vision_encoder)

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """What a vision-language export cannot do, refused before any weight is read."""
        geometry = vision_geometry(cfg.model)
        check_choice("quant.vision", cfg.quant.vision, [AUTO, *VISION_SCHEMES], "Fix quant.vision.")
        if geometry is None and cfg.model.image_size is not None:
            what = ("its vision encoder is not exported yet" if is_vision_language(cfg.model) else
                    "model.checkpoint is a text model")
            raise UserError(f"model.image_size={cfg.model.image_size} sizes a vision-language checkpoint's images, and "
                            f"{what}. Leave model.image_size unset.")
        if geometry is None:
            if cfg.quant.vision != AUTO:
                raise UserError(f"quant.vision={cfg.quant.vision} quantizes a vision-language checkpoint's image encoder, "
                                "and model.checkpoint is a text model. Leave quant.vision unset.")
            return
        what = f"{cfg.model.checkpoint} sees images ({geometry.family}, {geometry.tokens} positions per image)"
        exact = EXACT_INTEGERS.get(str(cfg.quant.dtype))
        if geometry.places_in_embedding and exact is not None and geometry.tokens > exact:
            raise UserError(f"{what}, and quant.dtype={cfg.quant.dtype} holds whole numbers exactly only up to {exact}: "
                            "each image token carries its place in the image to the decoder (docs/vision.md), which "
                            f"would be rounded. Use a smaller model.image_size (at most {exact} positions) or "
                            "quant.dtype=fp32.")
        check_runner_feeds(cfg, lengths, what, geometry.tokens, "an image")
        check_encoder_unbuilt(cfg, what, "image", "a vision-language")

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        """The vision encoder as a component of the plan (None for a text checkpoint)."""
        geometry = vision_geometry(cfg.model)
        if geometry is None:
            return None
        table = MethodTable({VISION_METHOD: vision_spec(geometry)}, {VISION_METHOD: None}, {}, {VISION_METHOD: VISION})
        return Component(name=VISION, kind=ComponentKind.vision_encoder, build=VisionBuild(cfg.model, geometry),
                         quant=QuantPlan(cfg.quant, cfg.export.tied_embedding, basis.shortcuts), methods=table)

    def decoder_methods(self, component: Component) -> Sequence[str]:
        return MULTIMODAL_METHODS

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        """The image encoder, alive beside the decoder from load to the end; read from the decoder's checkpoint."""
        checkpoint = ctx.main.checkpoint
        ctx.records[part.name] = VisionRecord(checkpoint)
        return encoder_footprint(vision_parameters(checkpoint.hf_config))

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        models[part.name] = part.component.build.build(ctx.record(part.name).checkpoint)

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows) -> None:
        """The image prompt validation will give the program, through the unquantized encoder and decoder."""
        ctx.record(part.name).baseline = unquantized_image_path(models[ctx.plan.main.name], models[part.name],
                                                                windows.windows[0])

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """After the decoder: the encoder's output must be in the dtype the decoder now computes in."""
        quant = part.component.quant.config
        ctx.record(part.name).quantization = quantize_vision(
            models[part.name], vision_scheme(quant), quant.group_size, models[ctx.plan.main.name].activation_dtype())

    def passes(self, part: Part) -> list[Any]:
        return [noop_expands_dropped()]

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        """What an app needs to make vision_encoder's input."""
        return vision_constants(part.component.build.geometry)

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        record = ctx.record(part.name)
        record.check = check_image_path(under.program, models[ctx.plan.main.name], models[part.name],
                                        under.text.windows[0], under.tolerance.max_kl, record.baseline)
        log.info("  validate: image path %s", "passed" if record.check.passed else "FAILED")

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        check = ctx.record(part.name).check
        return [f"the image path: {', '.join(check.failures)}"] if check is not None and not check.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """Its manifest entry; for a processor that takes a range of sizes (Qwen-VL), its files as the run keeps
        them, sized to the program's one square."""
        encoder = written.components[part.name]
        geometry = part.component.build.geometry
        staged = (processor_files_sized(ctx.record(part.name).checkpoint.path, geometry, pte.parent)
                  if geometry.size_chosen else {})
        return Finalized(ComponentEntry(
            kind=str(part.component.kind), methods=list(written.methods.of_component(part.name)), adapters=[],
            checkpoint=str(ctx.record(part.name).checkpoint.path), parameters=sum(p.numel() for p in encoder.parameters()),
            state=[], vision=self.entry(part, ctx)), staged=staged)

    def entry(self, part: Part, ctx: ExportContext) -> VisionEntry:
        """The manifest's record of the encoder: what an app does to a picture, and how the image path was checked."""
        geometry = part.component.build.geometry
        checkpoint, record = ctx.main.checkpoint, ctx.record(part.name)
        tokenizer = find_tokenizer(checkpoint.path)
        token = None
        if tokenizer is not None and tokenizer.name == "tokenizer.json":
            token = Tokenizer.from_file(str(tokenizer)).id_to_token(geometry.image_token_id)
        size = geometry.image_size
        return VisionEntry(family=geometry.family, image_size=size, tokens_per_image=geometry.tokens,
                           image_token_id=geometry.image_token_id, image_token=token,
                           prompt_marker=prompt_marker(load_processor(checkpoint.path)) if has_processor(checkpoint.path)
                           else None,
                           input=f"float32 [1, 3, {size}, {size}]: one RGB image, channels first, normalized",
                           preprocessing=self.preprocessing(part, checkpoint.path),
                           quantization=record.quantization or "fp32",
                           check=record.check)

    @staticmethod
    def preprocessing(part: Part, folder: Path) -> dict[str, Any]:
        """The processor's steps (:func:`exporters.program.vision.preprocessing`), with the size the program takes
        where the run's processor files were sized to it (Qwen-VL: :func:`processor_files_sized`)."""
        steps = preprocessing(folder)
        geometry = part.component.build.geometry
        if geometry.size_chosen:
            steps["size"] = geometry.sized()
        return steps

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        if stage == "load":
            return f"; {part.name}: {summary(models[part.name])}"
        if stage == "quantize":
            return f"; vision encoder: {ctx.record(part.name).quantization}"
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        """The bundle carries the processor files and says how an app feeds an image."""
        entry = self.entry_of(m)
        if entry is None or entry.vision is None:
            return Bundled()
        # The manifest's own form of it (Manifest.to_dict is asdict for components), without serializing it all again.
        return Bundled(readme=bundle_readme(entry.vision), files=list(PROCESSOR_FILES),
                       fields={"vision": dataclasses.asdict(entry.vision)})


def processor_files_sized(folder: Path, geometry: VisionGeometry, out_dir: Path) -> dict[Path, Path]:
    """``folder``'s processor files with their ``size`` fixed to the program's one square (``geometry.sized``),
    written under private names beside the program: final path -> that name (finalize renames them into place with
    the program, instead of the checkpoint's copies)."""
    staged: dict[Path, Path] = {}
    for name in PROCESSOR_FILES:
        source = folder / name
        if not source.is_file():
            continue
        saved = json.loads(source.read_text())
        fields = saved.get("image_processor", saved)  # processor_config.json nests it; preprocessor_config.json not
        fields["size"] = geometry.sized()
        for older in ("min_pixels", "max_pixels"):  # Qwen-VL's older names of its size
            fields.pop(older, None)
        staged[out_dir / name] = private_path(out_dir / name, "staged")
        staged[out_dir / name].write_text(json.dumps(saved, indent=2) + "\n")
    return staged


def bundle_readme(v: VisionEntry) -> str:
    """The bundle README's section on images: what an app does to a picture, and which runner takes it."""
    p = v.preprocessing
    processor = ("the processor files here do exactly this: `AutoProcessor.from_pretrained(<this folder>)`"
                 if v.family not in PATCH_ROW_FAMILIES else
                 "the processor files here are this family's, whose transformers processor keeps the picture's aspect "
                 "ratio and writes patch rows: `models.vision.load_processor(<this folder>)` of llm-exporters makes "
                 "one square, and `exporters.program.vision.program_pixels` folds its rows into these pixels")
    rows = (": replace the processor's patch rows by `program_pixels(inputs, " + str(v.image_size) + ")`"
            if v.family in PATCH_ROW_FAMILIES else "")
    return f"""## Images

`vision_encoder` takes one image as float32 `[1, 3, {v.image_size}, {v.image_size}]`: resize the picture to
{v.image_size} x {v.image_size}, multiply its RGB values by {p.get('rescale_factor', 1 / 255):.6g}, subtract
`{p.get('image_mean')}` and divide by `{p.get('image_std')}` per channel, channels first ({processor}). It returns the image's {v.tokens_per_image}
embeddings, which `text_decoder` takes at the next {v.tokens_per_image} positions; text goes through
`token_embedding` then `text_decoder`. In a prompt the image's place is token {v.image_token_id}
(`{v.image_token}`), {v.tokens_per_image} times.

- Android / iOS (C++): `MultimodalRunner` from `executorch/extension/llm/runner` with a list of inputs: text,
  `Image` (the float CHW pixels above), text; it calls the three methods in order and then decodes.
- Python: `executorch.extension.llm.runner.MultimodalRunner("<program>", "tokenizer.json")` and
  `generate_hf(runner, inputs=processor(images=..., text=...), image_token_id={v.image_token_id})` (its
  `pixel_values` as above{rows}).
- `python -m exporters.generate <this folder> prompt="... {v.prompt_marker} ..." image=<file>` (the processor turns
  `{v.prompt_marker}` into the image's tokens).

"""
