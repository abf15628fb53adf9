"""An encoder tower and projector of a multimodal checkpoint, built alone by transformers' own classes.

The whole model (a 3B decoder beside a 600M encoder) is only laid out on the meta device to find the parts' classes;
the parts are then built in fp32 and only their tensors read from the safetensors files. ``models.vision_encoder``
and ``models.audio_encoder`` wrap the parts into what the program's method computes.
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch
from torch import nn

from models.checkpoint import open_checkpoint, read_tensors
from models.decoder import mean_last

M = TypeVar("M", bound=nn.Module)


class quiet_transformers:
    """transformers' loading report and progress bars are library noise on the export's console."""

    def __enter__(self) -> None:
        import transformers

        self.level = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()

    def __exit__(self, *exc: object) -> None:
        import transformers

        transformers.utils.logging.set_verbosity(self.level)


def meta_model(hf_config: Any) -> nn.Module:
    """The whole multimodal model of ``hf_config`` on the meta device: its modules, nothing allocated."""
    import transformers

    with torch.device("meta"), quiet_transformers():
        return getattr(transformers, hf_config.architectures[0])(hf_config)


def load_parts(path: str, parts: dict[str, nn.Module], prefixes: dict[str, tuple[str, ...]], nested: str = "") -> None:
    """Read ``parts``' tensors (only theirs) from checkpoint folder ``path`` into them. ``prefixes``: part -> where
    checkpoints keep its tensors, in every layout transformers reads (the others are the text decoder's);
    ``nested``: a prefix some layouts put before the part's own names and others do not."""

    def part_name(stored: str) -> str | None:
        """``<part>.<name>`` of a checkpoint tensor (None: the text decoder's)."""
        for part, starts in prefixes.items():
            start = next((p for p in starts if stored.startswith(p)), None)
            if start is not None:
                return f"{part}.{stored[len(start):].removeprefix(nested)}"
        return None

    names = {f"{part}.{name.removeprefix(nested)}": (part, name) for part, module in parts.items()
             for name in module.state_dict()}
    states = {part: module.state_dict() for part, module in parts.items()}
    shapes = {ours: tuple(states[part][name].shape) for ours, (part, name) in names.items()}
    counters = frozenset(ours for ours, (part, name) in names.items() if not states[part][name].is_floating_point())
    tensors = read_tensors(open_checkpoint(path).weight_files, shapes, part_name, integers=counters)
    for part, module in parts.items():
        module.load_state_dict({name: tensors[ours] for ours, (owner, name) in names.items() if owner == part})


def randomized_zeros(parts: tuple[nn.Module, ...]) -> None:
    """Matrices transformers initializes to zero (Gemma 3's projector) drawn at random instead: a random-weight
    encoder whose every input embeds to nothing would test nothing."""
    with torch.no_grad():
        for p in (p for part in parts for p in part.parameters() if p.dim() > 1 and not p.any()):
            p.normal_(0.0, 0.02)


class DelegatedLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` of a ``[B, P, D]`` (or ``[1, H, W, D]``: LFM2-VL's projector) fp32 input in ops XNNPACK
    delegates (ExecuTorch 1.5.1's XNNPACK takes no ``layer_norm``: each of a ViT layer's two norms would end its
    partition and run on the portable kernels); the same mean and biased variance, equal to the fused kernel within
    float rounding (tests/test_vision_language.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp16 / bf16 keep the fused kernel's accuracy
        if x.dim() not in (3, 4) or x.dtype != torch.float32:
            return super().forward(x)
        if x.dim() == 3 and x.shape[0] != 1:  # several windows of audio [B, T, D]: one row of B * T positions
            return self.forward(x.reshape(1, -1, x.shape[-1])).reshape(x.shape)
        x = x.contiguous()  # a transposed input would make a transposed output, where the fused kernel's is contiguous
        centered = x - mean_last(x)
        return centered * torch.rsqrt(mean_last(centered * centered) + self.eps) * self.weight + self.bias


def delegated_norms(encoder: M) -> M:
    """Every plain ``nn.LayerNorm`` of the encoder over one dimension, with weight and bias (CLIP's, SigLIP's,
    Whisper's), computed as :class:`DelegatedLayerNorm` (the same parameters)."""
    for module in encoder.modules():
        if (type(module) is nn.LayerNorm and len(module.normalized_shape) == 1 and module.weight is not None
                and module.bias is not None):
            module.__class__ = DelegatedLayerNorm
    return encoder


def clip_bounds(clippable: nn.Module) -> tuple[float, float, float, float]:
    """A ``Gemma4ClippableLinear``'s input and output bounds as numbers, read once: inside a capture its stored
    tensors are inputs, not numbers."""
    names = ("input_min", "input_max", "output_min", "output_max")
    if not clippable.use_clipped_linears:
        return (-math.inf, math.inf, -math.inf, math.inf)
    low, high, out_low, out_high = (float(getattr(clippable, name)) for name in names)
    return low, high, out_low, out_high


def clipped_linear(clippable: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Gemma4ClippableLinear`` with its clamps as constants (``clippable.bounds``, from :func:`clip_bounds`: a clamp
    by numbers is one op XNNPACK takes, a clamp by tensors is not), none where it clamps nothing."""
    low, high, out_low, out_high = clippable.bounds
    if (low, high) != (-math.inf, math.inf):
        x = x.clamp(low, high)
    x = clippable.linear(x)
    return x if (out_low, out_high) == (-math.inf, math.inf) else x.clamp(out_low, out_high)


def gemma4_rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gemma 4's RMSNorm (``Gemma4RMSNorm``: in fp32, then cast back) of ``[1, T, D]`` or ``[1, T, H, D]`` through a
    mean XNNPACK delegates (``mean_last``) and ``rsqrt``: equal to transformers' within float rounding."""
    f = x.float()
    out = f * torch.rsqrt(mean_last(f * f) + norm.eps)
    return (out * norm.weight.float() if norm.with_scale else out).to(x.dtype)
