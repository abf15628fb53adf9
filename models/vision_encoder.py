"""The vision encoder of a vision-language checkpoint: pixels in, image embeddings in the text decoder's width out.

Built from transformers' own modules (the vision tower and the projector of the checkpoint's architecture), so it
computes what transformers computes; each family's wrapper only makes the path exportable and what ExecuTorch's
MultimodalRunner feeds: one image ``[1, 3, S, S]`` of the processor's normalized float pixels in, ``[1, N, hidden]``
out, N positions the runner gives the image in the text decoder. Parity with ``get_image_features``:
tests/test_vision_language.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.errors import ModelError
from models.towers import delegated_norms, load_parts, meta_model, quiet_transformers, randomized_zeros
from models.vision import geometry_of, vision_language_of


class VisionEncoder(nn.Module):
    """``forward(pixels [1, 3, S, S]) -> [1, N, hidden]``: one image, the positions it takes in the text decoder."""

    def __init__(self, config: Any, geometry: tuple[int, int]) -> None:
        super().__init__()
        # S: the square the processor resizes every image to; N: embedding positions per image.
        self.image_size, self.tokens = geometry
        self.compute_dtype = torch.float32  # what its weights and activations are in (quant.vision)
        self.out_dtype = torch.float32  # what the text decoder takes: MultimodalRunner converts nothing

    def describe(self) -> str:
        params = sum(p.numel() for p in self.parameters())
        return (f"{params / 1e6:.2f}M parameters, {self.image_size}x{self.image_size} images, {self.tokens} positions "
                "per image")

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.features(pixels.to(self.compute_dtype)).to(self.out_dtype)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class LlavaVision(VisionEncoder):
    """CLIP's layers up to ``vision_feature_layer`` (the later ones are never read: left out), the class token
    dropped (``default`` strategy), the projector."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry)
        layer, strategy = config.vision_feature_layer, config.vision_feature_select_strategy
        if not isinstance(layer, int):
            raise ModelError(f"vision_feature_layer={layer}: features concatenated from several CLIP layers are not "
                             "exported; checkpoints with one feature layer (llava-1.5, llava-interleave) are.")
        kept = layer if layer >= 0 else len(tower.encoder.layers) + 1 + layer
        self.embeddings, self.pre_layrnorm = tower.embeddings, tower.pre_layrnorm
        self.layers = nn.ModuleList(tower.encoder.layers[:kept])
        self.drop_class_token = strategy == "default"
        self.projector = projector

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.layers:
            h = layer(h, None)
            h = h[0] if isinstance(h, tuple) else h
        return self.projector(h[:, 1:] if self.drop_class_token else h)


class Gemma3Vision(VisionEncoder):
    """SigLIP's last hidden state, then Gemma 3's projector (average pooled to ``mm_tokens_per_image``, normed,
    projected). Gemma's image features are not multiplied by the text embedding scale."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry)
        self.tower, self.projector = tower, projector

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.projector(self.tower(pixel_values=pixels).last_hidden_state)


class Idefics3Vision(VisionEncoder):
    """Idefics3 / SmolVLM's SigLIP with every patch present (one whole image), then the connector (pixel shuffle and
    a linear). A whole image's patch positions are 0..P-1, a constant here: transformers derives them with
    ``torch.bucketize``, which ExecuTorch has no kernel for."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry)
        self.patch_embedding = tower.embeddings.patch_embedding
        self.position_embedding = tower.embeddings.position_embedding
        self.encoder, self.post_layernorm = tower.encoder, tower.post_layernorm
        self.connector = projector
        patches = self.tokens * config.scale_factor**2
        self.register_buffer("positions", torch.arange(patches).unsqueeze(0), persistent=False)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.position_embedding(self.positions)
        h = self.post_layernorm(self.encoder(inputs_embeds=h).last_hidden_state)
        return self.connector(h)


class Lfm2VlVision(VisionEncoder):
    """LFM2-VL's SigLIP2 (NaFlex) on one whole S x S image, then the projector (pixel unshuffle, norm, two linears).
    transformers resizes the position grid to each image's patch grid (antialiased bilinear, sizes read from the
    input): at one fixed size that is a constant, computed here once by transformers' own function. Its patch
    embedding is a linear on the processor's patch rows; the same weights as a stride-p convolution take the
    ``[1, 3, S, S]`` image the runner feeds (the rows' layout, channel fastest, folded into the kernel)."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry)
        embeddings, p = tower.embeddings, config.vision_config.patch_size
        self.grid = self.image_size // p  # patches per side
        linear = embeddings.patch_embedding
        self.patch_embedding = nn.Conv2d(config.vision_config.num_channels, linear.out_features, p, stride=p)
        with torch.no_grad():
            self.patch_embedding.weight.copy_(linear.weight.view(linear.out_features, p, p, -1).permute(0, 3, 1, 2))
            self.patch_embedding.bias.copy_(linear.bias)
            side = embeddings.position_embedding_size
            grid = embeddings.position_embedding.weight.reshape(side, side, -1)
            positions = embeddings.resize_positional_embeddings(grid, torch.tensor([[self.grid, self.grid]]),
                                                                self.grid**2)
        self.register_buffer("positions", positions, persistent=False)
        self.encoder, self.post_layernorm = tower.encoder, tower.post_layernorm
        self.projector = projector

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(pixels).flatten(2).transpose(1, 2) + self.positions
        h = self.post_layernorm(self.encoder(inputs_embeds=h).last_hidden_state)
        return self.projector(h.reshape(1, self.grid, self.grid, -1)).reshape(1, self.tokens, -1)


ENCODERS: dict[str, type[VisionEncoder]] = {"llava": LlavaVision, "gemma3": Gemma3Vision, "idefics3": Idefics3Vision,
                                            "lfm2_vl": Lfm2VlVision}


def _parts(model: Any) -> tuple[nn.Module, nn.Module]:
    """A transformers vision-language model's vision tower and projector (connector)."""
    inner = model.model
    if hasattr(inner, "vision_model"):  # Idefics3, SmolVLM
        return inner.vision_model, inner.connector
    return inner.vision_tower, inner.multi_modal_projector


# Where a checkpoint keeps the vision tower's and the projector's tensors, in every layout transformers reads: the hub's
# older ``vision_tower.vision_model.*``, transformers 5's ``model.vision_tower.*`` (saved back as ``vision_tower.*``),
# Idefics3's ``model.vision_model.*`` and ``model.connector.*``.
PART_PREFIXES: dict[str, tuple[str, ...]] = {
    "tower": ("model.vision_tower.", "vision_tower.", "model.vision_model."),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector.", "model.connector.")}
NESTED = "vision_model."  # CLIP's and SigLIP's layers are under it in some layouts and not in others


def load_vision_encoder(path: str, hf_config: Any, geometry: tuple[int, int] | None = None) -> VisionEncoder:
    """The vision encoder of the checkpoint folder ``path`` in fp32: the tower and projector built alone, and only
    their tensors read from the safetensors files (the text decoder's are not read: a 4B checkpoint's vision
    tower costs its own 1.7 GB, not the whole model in fp32). ``geometry``: (S, N) as the plan decided it; None:
    from the folder's files (:func:`models.vision.geometry_of`)."""
    family = vision_language_of(hf_config)
    assert family is not None, "a vision-language checkpoint"
    tower, projector = _new_parts(hf_config)
    load_parts(path, {"tower": tower, "projector": projector}, PART_PREFIXES, NESTED)
    geometry = geometry or geometry_of(hf_config, path)
    return delegated_norms(ENCODERS[family.name](hf_config, geometry, tower, projector)).eval()


def _new_parts(hf_config: Any) -> tuple[nn.Module, nn.Module]:
    """The vision tower and projector of ``hf_config``'s architecture in fp32 with transformers' initialization, built
    alone: the whole model is only laid out on the meta device to find their classes."""
    hf_config._attn_implementation = "eager"
    tower, projector = _parts(meta_model(hf_config))
    with quiet_transformers():
        return type(tower)(hf_config.vision_config), type(projector)(hf_config)


def vision_parameters(hf_config: Any) -> int:
    """The vision tower's and projector's parameters (all of the tower's layers: an upper bound for LLaVA, which reads
    fewer), counted on the meta device: nothing allocated."""
    return sum(p.numel() for part in _parts(meta_model(hf_config)) for p in part.parameters())


def random_vision_encoder(hf_config: Any, seed: int = 0, geometry: tuple[int, int] | None = None) -> VisionEncoder:
    """The vision encoder of ``hf_config``'s shape with seeded random weights (transformers' own initialization).
    ``geometry``: (S, N) as the plan decided it; None: the config's alone (no processor files)."""
    family = vision_language_of(hf_config)
    assert family is not None, "a vision-language config"
    torch.manual_seed(seed)
    parts = _new_parts(hf_config)
    randomized_zeros(parts)  # Gemma 3's projector starts at zero: random images would all embed to nothing
    geometry = geometry or geometry_of(hf_config, None)
    return delegated_norms(ENCODERS[family.name](hf_config, geometry, *parts)).eval()
