"""The vision encoder of a vision-language checkpoint: pixels in, image embeddings in the text decoder's width out.

Built from transformers' own modules (the vision tower and the projector of the checkpoint's architecture), so it
computes what transformers computes; each family's wrapper only makes the path exportable and what ExecuTorch's
MultimodalRunner feeds: one image ``[1, 3, S, S]`` of the processor's normalized float pixels in, ``[1, N, hidden]``
out (Qwen-VL: wider, what its M-RoPE decoder takes), N positions the runner gives the image in the text decoder.
Parity with ``get_image_features``: tests/test_vision_language.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.decoder import id_digits, mean_last
from models.errors import ModelError
from models.towers import (clip_bounds, clipped_linear, delegated_norms, gemma4_rms_norm, load_parts, meta_model,
                           quiet_transformers, randomized_zeros)
from models.vision import geometry_of, text_only, vision_language_of


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


# --- Qwen2.5-VL and Qwen3-VL -----------------------------------------------------------------------------------------
# transformers runs these towers on the processor's flattened patch rows of any grid, deriving positions, attention
# windows and the position-table resampling from the grid at run time (``.tolist()``, ``repeat_interleave``,
# ``argsort``): nothing ``torch.export`` can keep. At one image size all of that is a constant, computed here once by
# transformers' own functions (``transformers.vision_utils``); the blocks' weights run through plain ops. The image
# ``[1, 3, S, S]`` is cut into patches by a convolution whose weight is the tower's 3-D patch weight summed over its
# two frames (a still image is its own two frames), and the patches are put in the order the processor writes them
# (2 x 2 merge blocks, row by row). The output is the wide embedding the M-RoPE decoder takes
# (``models.decoder.DecoderArgs.embedding_width``): the merged features, then Qwen3-VL's deepstack features, then each
# token's place in the image and the image's rows and columns of positions (``models.decoder.IMAGE_CHANNELS``), from
# which the decoder places the image's M-RoPE positions.
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_vision`` on one of q/k [1, S, heads, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's vision RMSNorm through a mean XNNPACK delegates (``mean_last``)."""
    return norm.weight * (x * torch.rsqrt(mean_last(x * x) + norm.variance_epsilon))


def _split_qkv(attn: nn.Module) -> None:
    """The fused ``qkv`` projection as ``q_proj``, ``k_proj``, ``v_proj`` (its rows, moved): three matrix products and
    no split of their output, which XNNPACK would leave to the portable kernels between partitions."""
    qkv = attn.qkv
    width = qkv.out_features // 3
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        proj = nn.Linear(qkv.in_features, width, bias=qkv.bias is not None, device=qkv.weight.device,
                         dtype=qkv.weight.dtype)
        with torch.no_grad():
            proj.weight.copy_(qkv.weight[i * width:(i + 1) * width])
            if qkv.bias is not None:
                proj.bias.copy_(qkv.bias[i * width:(i + 1) * width])
        setattr(attn, name, proj)
    del attn.qkv


class QwenVisionBase(VisionEncoder):
    """What both towers share: the patch convolution, constant rotary tables, the blocks' attention, the image
    channels. ``features`` is the family's."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: None = None) -> None:
        """``projector``: none (the tower holds its merger); taken as every family's encoder is built."""
        from transformers.vision_utils import get_vision_position_ids

        super().__init__(config, geometry)
        vc = config.vision_config
        self.patch, self.merge = vc.patch_size, vc.spatial_merge_size
        self.grid = self.image_size // self.patch  # patches per side
        self.heads = vc.num_heads
        conv3d = tower.patch_embed.proj
        width = conv3d.out_channels
        self.patch_embedding = nn.Conv2d(conv3d.in_channels, width, self.patch, stride=self.patch,
                                         bias=conv3d.bias is not None)
        with torch.no_grad():
            self.patch_embedding.weight.copy_(conv3d.weight.sum(2))
            if conv3d.bias is not None:
                self.patch_embedding.bias.copy_(conv3d.bias)
        self.grid_thw = torch.tensor([[1, self.grid, self.grid]])
        with torch.no_grad():
            cos, sin = tower.rotary_pos_emb(torch.zeros(1), get_vision_position_ids(self.grid_thw, self.merge))
        self.register_buffer("rope_cos", cos[None, :, None, :].float(), persistent=False)  # [1, P, 1, head_dim]
        self.register_buffer("rope_sin", sin[None, :, None, :].float(), persistent=False)
        side = self.grid // self.merge
        channels = torch.stack([torch.arange(1, side * side + 1).float(), torch.full((side * side,), float(side)),
                                torch.full((side * side,), float(side))], dim=-1)
        self.register_buffer("image_channels", channels[None], persistent=False)  # [1, N, 3]: models.decoder's
        self.blocks = tower.blocks
        for block in self.blocks:
            _split_qkv(block.attn)

    def patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """[1, 3, S, S] -> [1, P, width] in the processor's order: merge blocks row by row, each block's patches row
        by row."""
        g, m = self.grid, self.merge
        x = self.patch_embedding(pixels).reshape(-1, g // m, m, g // m, m)  # [width, blocks, m, blocks, m]
        return x.permute(1, 3, 2, 4, 0).reshape(1, g * g, -1)

    def attend(self, attn: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """A block's attention over the image's patches [1, P, width] (``mask``: Qwen2.5-VL's windows)."""
        p = x.shape[1]
        q, k, v = (proj(x).reshape(1, p, self.heads, -1) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = _rotate(q, self.rope_cos, self.rope_sin), _rotate(k, self.rope_cos, self.rope_sin)
        # As transformers' eager attention computes it: matmuls and a softmax XNNPACK takes (torch's SDPA decomposes
        # into masked ops that end the partition).
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) * attn.scaling
        if mask is not None:
            scores = scores + mask
        out = torch.softmax(scores, dim=-1) @ v.transpose(1, 2)
        return attn.proj(out.transpose(1, 2).reshape(1, p, -1))

    def merged(self, x: torch.Tensor) -> torch.Tensor:
        """[1, P, width] -> [1, N, 4 * width]: each merge block's patches side by side."""
        return x.reshape(1, self.tokens, -1)


class Qwen3VlVision(QwenVisionBase):
    """Qwen3-VL (and Qwen3.5, without deepstack): a learned position table resampled to the grid (a constant),
    LayerNorm blocks attending over the whole image, the merger, and a deepstack merger after each of
    ``deepstack_visual_indexes``' blocks."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: None = None) -> None:
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        super().__init__(config, geometry, tower)
        with torch.no_grad():
            indices, weights = get_vision_interpolation_indices_and_weights(
                self.grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
                align_corners=tower.interpolation_align_corners, spatial_merge_size=self.merge)
            positions = (tower.pos_embed(indices) * weights[:, :, None]).sum(1)
        self.register_buffer("positions", positions[None].float(), persistent=False)
        self.merger = tower.merger
        self.deepstack_at = list(getattr(tower, "deepstack_visual_indexes", []))  # Qwen3.5's tower has none
        self.deepstack_mergers = getattr(tower, "deepstack_merger_list", nn.ModuleList())

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patches(pixels) + self.positions
        deep = []
        for i, block in enumerate(self.blocks):
            x = x + self.attend(block.attn, block.norm1(x), None)
            x = x + block.mlp(block.norm2(x))
            if i in self.deepstack_at:  # normed after the merge (use_postshuffle_norm)
                merger = self.deepstack_mergers[self.deepstack_at.index(i)]
                deep.append(self._project(merger, merger.norm(self.merged(x))))
        out = self._project(self.merger, self.merged(self.merger.norm(x)))
        return torch.cat([out, *deep, self.image_channels], dim=-1)

    @staticmethod
    def _project(merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return merger.linear_fc2(merger.act_fn(merger.linear_fc1(x)))


class Qwen25VlVision(QwenVisionBase):
    """Qwen2.5-VL: RMSNorm blocks with gated MLPs; all but ``fullatt_block_indexes`` attend within windows of
    ``window_size`` pixels (transformers permutes the patches window by window and back; here each patch attends to
    its own window's through a constant mask, the same sums in the processor's order); the merger."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: None = None) -> None:
        from transformers.vision_utils import get_vision_window_index

        super().__init__(config, geometry, tower)
        vc = config.vision_config
        order, bounds = get_vision_window_index(self.grid_thw, spatial_merge_size=self.merge,
                                                window_size=vc.window_size, patch_size=self.patch)
        unit = self.merge**2
        window = torch.empty(self.tokens, dtype=torch.int64)  # each merged token's window
        for w, (start, end) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
            window[order[start // unit:end // unit]] = w
        window = window.repeat_interleave(unit)  # each patch's
        mask = torch.zeros(window.numel(), window.numel())
        mask.masked_fill_(window[:, None] != window[None, :], float("-inf"))
        self.register_buffer("window_mask", mask, persistent=False)
        self.full_attention = set(vc.fullatt_block_indexes)
        self.merger = tower.merger

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patches(pixels)
        for i, block in enumerate(self.blocks):
            mask = None if i in self.full_attention else self.window_mask
            x = x + self.attend(block.attn, _rms_norm(block.norm1, x), mask)
            x = x + block.mlp(_rms_norm(block.norm2, x))
        out = self.merger.mlp(self.merged(_rms_norm(self.merger.ln_q, x)))
        return torch.cat([out, self.image_channels], dim=-1)


def _kv_heads_repeated(attn: nn.Module, groups: int) -> None:
    """Grouped-query attention as plain multi-head: each key and value head's projection rows repeated for the query
    heads that read it (their norms have one weight for every head), the same sums without a repeat of k and v per
    image, which XNNPACK would leave to the portable kernels between partitions."""
    for proj in (attn.k_proj, attn.v_proj):
        linear = proj.linear
        rows = linear.weight.view(-1, attn.head_dim, linear.in_features).repeat_interleave(groups, dim=0)
        wider = nn.Linear(linear.in_features, rows.shape[0] * attn.head_dim, bias=False)
        with torch.no_grad():
            wider.weight.copy_(rows.reshape(-1, linear.in_features))
        proj.linear = wider


class Gemma4Vision(VisionEncoder):
    """Gemma 4's tower on one whole S x S image, then ``embed_vision``. transformers runs it on the processor's patch
    rows with each row's (x, y) position, padded to the token budget, pooling by a one-hot matrix of the positions and
    stripping the padding by a boolean index (nothing ``torch.export`` keeps). For one whole image every position is a
    constant: the learned x and y position embeddings summed, the 2-D rotary tables, and pooling as k x k averages
    of the grid. The patch linear takes ``2 x - 1`` of the rows (the pixels in [0, 1]); as a stride-p convolution it
    takes the ``[1, 3, S, S]`` image (the rows' layout, channel fastest, folded into the kernel). The output carries
    the image token's id beside the features (``models.decoder.ID_DIGITS``): the per-layer embeddings look it up."""

    def __init__(self, config: Any, geometry: tuple[int, int], tower: nn.Module, projector: nn.Module) -> None:
        super().__init__(config, geometry)
        vc = config.vision_config
        p, self.pool = vc.patch_size, vc.pooling_kernel_size
        self.grid = self.image_size // p  # patches per side
        linear = tower.patch_embedder.input_proj
        self.patch_embedding = nn.Conv2d(3, linear.out_features, p, stride=p, bias=False)
        with torch.no_grad():
            self.patch_embedding.weight.copy_(linear.weight.view(linear.out_features, p, p, 3).permute(0, 3, 1, 2))
            table = tower.patch_embedder.position_embedding_table  # [2, side, D]: x then y
            g = self.grid
            positions = (table[0][:g][None, :, :] + table[1][:g][:, None, :]).reshape(1, g * g, -1)  # rows of y
            xs, ys = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="xy")
            cos, sin = tower.encoder.rotary_emb(positions, torch.stack([xs, ys], -1).reshape(1, g * g, 2))
        self.register_buffer("positions", positions.float(), persistent=False)
        self.register_buffer("rope_cos", cos[:, :, None, :].float(), persistent=False)  # [1, P, 1, head_dim]
        self.register_buffer("rope_sin", sin[:, :, None, :].float(), persistent=False)
        self.layers = tower.encoder.layers
        for module in self.layers.modules():
            if hasattr(module, "use_clipped_linears"):
                module.bounds = clip_bounds(module)
        self.heads = vc.num_attention_heads
        if vc.num_key_value_heads != self.heads:
            for layer in self.layers:
                _kv_heads_repeated(layer.self_attn, self.heads // vc.num_key_value_heads)
        self.root_width = vc.hidden_size**0.5
        self.standardize = bool(vc.standardize)
        if self.standardize:
            self.register_buffer("std_bias", tower.std_bias.detach().float().clone(), persistent=False)
            self.register_buffer("std_scale", tower.std_scale.detach().float().clone(), persistent=False)
        self.projector = projector
        token = torch.tensor([[int(config.image_token_id)]] * self.tokens).T  # [1, N]
        self.register_buffer("token_ids", id_digits(token, torch.float32), persistent=False)  # [1, N, 3]

    @staticmethod
    def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return gemma4_rms_norm(norm, x)

    @staticmethod
    def _linear(clippable: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return clipped_linear(clippable, x)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """2-D axial RoPE on q or k [1, P, heads, head_dim]: the first half of each head turned by x, the second by
        y, each half by rotating its own halves (transformers' ``apply_multidimensional_rope``)."""
        q = x.shape[-1] // 4  # slices, which XNNPACK takes (a split it does not)
        turned = torch.cat([-x[..., q:2 * q], x[..., :q], -x[..., 3 * q:], x[..., 2 * q:3 * q]], dim=-1)
        return x * self.rope_cos + turned * self.rope_sin

    def _attend(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Bidirectional attention over the image's patches [1, P, width], scaled by 1 (q and k are normed)."""
        n = x.shape[1]
        q, k, v = (self._linear(proj, x).reshape(1, n, self.heads, -1)
                   for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = self._rotate(self._norm(attn.q_norm, q)), self._rotate(self._norm(attn.k_norm, k))
        v = self._norm(attn.v_norm, v)
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1)
        out = torch.softmax(scores, dim=-1) @ v.transpose(1, 2)  # [1, heads, P, head_dim]
        return self._linear(attn.o_proj, out.transpose(1, 2).reshape(1, n, -1))

    def _mlp(self, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self._linear(mlp.down_proj, mlp.act_fn(self._linear(mlp.gate_proj, x)) * self._linear(mlp.up_proj, x))

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(2 * pixels - 1).flatten(2).transpose(1, 2) + self.positions
        for layer in self.layers:
            h = h + self._norm(layer.post_attention_layernorm, self._attend(layer.self_attn,
                                                                            self._norm(layer.input_layernorm, h)))
            h = h + self._norm(layer.post_feedforward_layernorm, self._mlp(layer.mlp,
                                                                           self._norm(layer.pre_feedforward_layernorm, h)))
        g = self.grid
        grid = h.float().transpose(1, 2).reshape(1, -1, g, g)  # [1, D, rows, columns]
        # Pooled, scaled and standardized in fp32 (the scale can pass fp16's range), as transformers does
        pooled = torch.nn.functional.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2) * self.root_width
        if self.standardize:
            pooled = (pooled - self.std_bias) * self.std_scale
        embed = self.projector  # embed_vision: an unweighted RMSNorm, then a linear to the decoder's width
        out = embed.embedding_projection(self._norm(embed.embedding_pre_projection_norm, pooled.to(h.dtype)))
        return torch.cat([out, self.token_ids.to(out.dtype)], dim=-1)


ENCODERS: dict[str, type[VisionEncoder]] = {"llava": LlavaVision, "gemma3": Gemma3Vision, "idefics3": Idefics3Vision,
                            "lfm2_vl": Lfm2VlVision, "qwen2_5_vl": Qwen25VlVision, "qwen3_vl": Qwen3VlVision,
                                               "qwen3_5": Qwen3VlVision, "gemma4": Gemma4Vision}


def _parts(model: Any) -> tuple[nn.Module, nn.Module | None]:
    """A transformers vision-language model's vision tower and projector (connector); Qwen-VL's tower holds its
    merger (no projector)."""
    inner = model.model
    if hasattr(inner, "visual"):  # Qwen2.5-VL, Qwen3-VL
        return inner.visual, None
    if hasattr(inner, "vision_model"):  # Idefics3, SmolVLM
        return inner.vision_model, inner.connector
    if hasattr(inner, "embed_vision"):  # Gemma 4
        return inner.vision_tower, inner.embed_vision
    return inner.vision_tower, inner.multi_modal_projector


# Where a checkpoint keeps the vision tower's and the projector's tensors, in every layout transformers reads: the hub's
# older ``vision_tower.vision_model.*``, transformers 5's ``model.vision_tower.*`` (saved back as ``vision_tower.*``),
# Idefics3's ``model.vision_model.*`` and ``model.connector.*``.
PART_PREFIXES: dict[str, tuple[str, ...]] = {
    "tower": ("model.vision_tower.", "vision_tower.", "model.vision_model.", "model.visual.", "visual."),
    "projector": ("model.multi_modal_projector.", "multi_modal_projector.", "model.connector.", "model.embed_vision.")}
NESTED = "vision_model."  # CLIP's and SigLIP's layers are under it in some layouts and not in others


def load_vision_encoder(path: str, hf_config: Any, geometry: tuple[int, int] | None = None) -> VisionEncoder:
    """The vision encoder of the checkpoint folder ``path`` in fp32: the tower and projector built alone, and only
    their tensors read from the safetensors files (the text decoder's are not read: a 4B checkpoint's vision
    tower costs its own 1.7 GB, not the whole model in fp32). ``geometry``: (S, N) as the plan decided it; None:
    from the folder's files (:func:`models.vision.geometry_of`)."""
    family = vision_language_of(hf_config)
    assert family is not None, "a vision-language checkpoint"
    tower, projector = _new_parts(hf_config)
    parts = {"tower": tower} if projector is None else {"tower": tower, "projector": projector}
    load_parts(path, parts, PART_PREFIXES, NESTED)
    geometry = geometry or geometry_of(hf_config, path)
    if geometry is None:
        raise ModelError(f"{path}: {text_only(hf_config, path)}; its image encoder is not built")
    return delegated_norms(ENCODERS[family.name](hf_config, geometry, tower, projector)).eval()


def _new_parts(hf_config: Any) -> tuple[nn.Module, nn.Module | None]:
    """The vision tower and projector of ``hf_config``'s architecture in fp32 with transformers' initialization, built
    alone: the whole model is only laid out on the meta device to find their classes."""
    hf_config._attn_implementation = "eager"
    tower, projector = _parts(meta_model(hf_config))
    with quiet_transformers():
        if projector is not None and type(projector).__name__ == "Gemma4MultimodalEmbedder":
            return type(tower)(hf_config.vision_config), type(projector)(hf_config.vision_config, hf_config.text_config)
        return type(tower)(hf_config.vision_config), None if projector is None else type(projector)(hf_config)


def vision_parameters(hf_config: Any) -> int:
    """The vision tower's and projector's parameters (all of the tower's layers: an upper bound for LLaVA, which reads
    fewer), counted on the meta device: nothing allocated."""
    return sum(p.numel() for part in _parts(meta_model(hf_config)) if part is not None for p in part.parameters())


def random_vision_encoder(hf_config: Any, seed: int = 0, geometry: tuple[int, int] | None = None) -> VisionEncoder:
    """The vision encoder of ``hf_config``'s shape with seeded random weights (transformers' own initialization).
    ``geometry``: (S, N) as the plan decided it; None: the config's alone (no processor files)."""
    family = vision_language_of(hf_config)
    assert family is not None, "a vision-language config"
    torch.manual_seed(seed)
    parts = _new_parts(hf_config)
    # Gemma 3's projector starts at zero: random images would all embed to nothing
    randomized_zeros(tuple(part for part in parts if part is not None))
    geometry = geometry or geometry_of(hf_config, None)
    assert geometry is not None, "without processor files every built family has a size"
    return delegated_norms(ENCODERS[family.name](hf_config, geometry, *parts)).eval()
