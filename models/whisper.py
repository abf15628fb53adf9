"""Whisper as the two methods ExecuTorch's ``AsrRunner`` calls: ``encoder`` and ``text_decoder``, over one state.

The runner (``extension/asr/runner/seq2seq_runner.cpp``) runs ``encoder(features [1, mels, 3000])`` once per
audio and then ``text_decoder(token [1, 1] int64, encoder_states, cache_position [1] int64)`` once per token,
passing the encoder's output again at every step; it reads the last position's logits. What the decoder's
cross-attention needs of the audio (each layer's keys and values of the encoder states) is the same at every
step, so :meth:`WhisperProgram.encode` computes it once and keeps it in buffers both methods name alike
(``cross_k.<layer>``, ``cross_v.<layer>``): the program shares them, as it shares the self-attention cache between
calls. ``text_decoder`` takes the encoder states as the runner passes them and does not read them.

The layers are transformers' own modules (``WhisperForConditionalGeneration``'s weights, unchanged; the encoder with
transformers' eager attention); the decoder's step is written here over them, in the same order of operations (the
query scaled before its product, GELU, pre-norm residuals). Every key is stored transposed (``[1, heads, head_dim,
positions]``), so a step multiplies by it as it is: ``scaled_dot_product_attention`` on stored keys lowered to a
transpose, a multiplication by the scale and a copy of the keys at every step, and checks for fully masked rows on
the portable kernels (21 ms of a Whisper base step: docs/DESIGN.md). ``text_decoder`` takes any number of tokens up
to the cache (the prompt's four in one call, or one), at positions ``cache_position``; positions past the last
written are masked, so a new audio needs no reset: its first call writes from position 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from models.ctranslate2 import is_ctranslate2
from models.kv_cache import CacheGeometry
from models.processor_files import saved_architectures

ENCODER = "encoder"
TEXT_DECODER = "text_decoder"
ARCHITECTURES = ("WhisperForConditionalGeneration",)


def is_whisper(path: Path) -> bool:
    """Whether folder ``path`` holds a Whisper model: a Hugging Face checkpoint of it, or faster-whisper's files."""
    return is_ctranslate2(path) or any(a in ARCHITECTURES for a in saved_architectures(path))


@dataclass(frozen=True)
class WhisperShape:
    """What the program's inputs and buffers are sized by, read from the checkpoint's config."""

    mel_bins: int
    frames: int  # the encoder's input frames: 2 x its positions (the second convolution has stride 2)
    audio_positions: int
    text_positions: int  # the decoder's learned positions: the most tokens one transcript window holds
    heads: int
    head_dim: int
    layers: int
    vocab: int

    @staticmethod
    def of(config: Any) -> "WhisperShape":
        return WhisperShape(config.num_mel_bins, 2 * config.max_source_positions, config.max_source_positions,
                            config.max_target_positions, config.decoder_attention_heads,
                            config.d_model // config.decoder_attention_heads, config.decoder_layers, config.vocab_size)


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[1, T, heads * head_dim] -> [1, heads, T, head_dim]."""
    return x.view(x.shape[0], x.shape[1], heads, -1).transpose(1, 2)


def _merged(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, head_dim] -> [1, T, heads * head_dim]."""
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


class WhisperProgram(nn.Module):
    """transformers' Whisper with the state an exported program keeps: each decoder layer's self-attention cache
    and its cross-attention keys and values of the current audio."""

    def __init__(self, hf: nn.Module, max_tokens: int | None = None) -> None:
        super().__init__()
        config = hf.config
        self.shape = WhisperShape.of(config)
        self.max_tokens = min(max_tokens or self.shape.text_positions, self.shape.text_positions)
        self.audio = hf.model.encoder
        self.text = hf.model.decoder
        self.proj_out = hf.proj_out
        s = self.shape
        self.caches = nn.ModuleList(_State(s.heads, self.max_tokens, s.head_dim) for _ in range(s.layers))
        self.cross = nn.ModuleList(_State(s.heads, s.audio_positions, s.head_dim) for _ in range(s.layers))
        self.register_buffer("slots", torch.arange(self.max_tokens), persistent=False)
        # Logits from the token embedding's own parameter (the output projection is tied to it): ``h @ W^T`` through
        # proj_out would let a delegate keep a second copy of the largest matrix (as CausalLM.head explains).
        self.tied_head = hf.proj_out.weight is hf.model.decoder.embed_tokens.weight

    # -- encoder ---------------------------------------------------------------------------------------------------
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel ``features`` [1, mels, frames] -> encoder states [1, audio_positions, d_model]; each decoder
        layer's cross-attention keys and values of them are kept for :meth:`decode`."""
        states = self.audio(features).last_hidden_state
        for layer, cross in zip(self.text.layers, self.cross):
            attn = layer.encoder_attn
            cross.keep(_heads(attn.k_proj(states), self.shape.heads), _heads(attn.v_proj(states), self.shape.heads))
        return states

    # -- text decoder ----------------------------------------------------------------------------------------------
    def decode(self, tokens: torch.Tensor, encoder_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits [1, T, vocab] of ``tokens`` [1, T] at ``positions`` [T] (consecutive), attending to the cache and
        to the audio :meth:`encode` kept. ``encoder_states`` is the runner's argument, not read."""
        for cross in self.cross:
            cross.touch()
        text = self.text
        x = text.embed_tokens(tokens) + text.embed_positions.weight[positions].unsqueeze(0)
        mask = CacheGeometry(self.max_tokens).mask(positions, x.dtype, self.slots)
        for layer, cache, cross in zip(text.layers, self.caches, self.cross):
            x = x + self._self_attention(layer.self_attn, layer.self_attn_layer_norm(x), cache, positions, mask)
            x = x + self._cross_attention(layer.encoder_attn, layer.encoder_attn_layer_norm(x), cross)
            x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
        h = text.layer_norm(x)
        return (text.embed_tokens.weight @ h.mT).mT if self.tied_head else self.proj_out(h)

    def _self_attention(self, attn: nn.Module, h: torch.Tensor, cache: "_State", positions: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
        heads = self.shape.heads
        q = _heads(attn.q_proj(h) * attn.scaling, heads)
        cache.write(_heads(attn.k_proj(h), heads), _heads(attn.v_proj(h), heads), positions)
        return attn.out_proj(_merged(cache.attend(q, mask)))

    def _cross_attention(self, attn: nn.Module, h: torch.Tensor, cross: "_State") -> torch.Tensor:
        q = _heads(attn.q_proj(h) * attn.scaling, self.shape.heads)
        return attn.out_proj(_merged(cross.attend(q)))

    @torch.no_grad()
    def reset(self) -> None:
        for module in (*self.caches, *self.cross):
            for buffer in module.buffers():
                buffer.zero_()


class _State(nn.Module):
    """One decoder layer's keys (transposed: ``k_t`` [1, heads, head_dim, positions]) and values ([1, heads,
    positions, head_dim]): the self-attention cache, written at the call's positions, or the cross-attention's of the
    current audio, written whole by ``encode``. (Three-dimensional buffers and ``bmm`` were slower: 14.0 against
    11.7 ms a step on Whisper base 8da4w.)

    ``text_decoder`` only reads the cross-attention's; a buffer a method does not write is a constant of that method
    in ExecuTorch, so :meth:`touch` writes nothing into them (an empty ``index_copy_``) to make them the program's
    shared state in both methods."""

    def __init__(self, heads: int, positions: int, head_dim: int) -> None:
        super().__init__()
        self.register_buffer("k_t", torch.zeros(1, heads, head_dim, positions), persistent=False)
        self.register_buffer("v", torch.zeros(1, heads, positions, head_dim), persistent=False)
        self.register_buffer("nothing", torch.zeros(0, dtype=torch.long), persistent=False)

    def write(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """``k`` / ``v`` [1, heads, T, head_dim] at ``positions`` [T] (an in-place ``index_put_`` after emit)."""
        self.k_t.index_copy_(3, positions, k.transpose(2, 3))
        self.v.index_copy_(2, positions, v)

    def keep(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every position at once (the encoder's states)."""
        self.k_t.copy_(k.transpose(2, 3))
        self.v.copy_(v)

    def touch(self) -> None:
        self.k_t.index_copy_(3, self.nothing, self.k_t[..., :0])
        self.v.index_copy_(2, self.nothing, self.v[:, :, :0])

    def attend(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T + mask) v for ``q`` [1, heads, T, head_dim], already scaled (as transformers' eager
        attention computes it)."""
        scores = q @ self.k_t
        if mask is not None:
            scores = scores + mask
        return scores.softmax(dim=-1) @ self.v


class EncoderMethod(nn.Module):
    """``encoder`` as ``torch.export`` captures it. Each method module holds the same program under the same name,
    so the methods' buffers are named alike and the program shares them."""

    def __init__(self, program: WhisperProgram) -> None:
        super().__init__()
        self.whisper = program

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.whisper.encode(features)


class TextDecoderMethod(nn.Module):
    """``text_decoder`` as ``torch.export`` captures it (see :class:`EncoderMethod`)."""

    def __init__(self, program: WhisperProgram) -> None:
        super().__init__()
        self.whisper = program

    def forward(self, tokens: torch.Tensor, encoder_states: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        return self.whisper.decode(tokens, encoder_states, cache_position)


def example_inputs(shape: WhisperShape, method: str, tokens: int = 1) -> tuple[torch.Tensor, ...]:
    """Inputs of ``method`` as the runner gives them: features, or (tokens, encoder states, positions)."""
    if method == ENCODER:
        return (torch.zeros(1, shape.mel_bins, shape.frames),)
    return (torch.zeros(1, tokens, dtype=torch.long), torch.zeros(1, shape.audio_positions, shape.heads * shape.head_dim),
            torch.arange(tokens, dtype=torch.long))
