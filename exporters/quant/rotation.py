"""Rotations that make a model quantize well without changing what it computes (``quant.rotation``,
``quant.online_hadamard``; QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024).

A linear layer's outliers (a few input channels a hundred times the others) waste a 4-bit group's scale on
them. An orthogonal Q spreads every channel over all of them, and ``W x = (W Q)(Q^T x)``: rotate the
weights offline and the activations they read, and nothing changes but how the weights quantize.

- **R1**, the residual stream: the embedding writes ``h Q``, every linear that reads the stream (after an
  RMSNorm, whose gain is first folded into it: ``W diag(g) Q``) reads it rotated, every linear that writes it
  (``o_proj``, ``down_proj``) writes ``Q^T W``. RMSNorm commutes with Q once its gain is folded (a rotation
  keeps the norm). A tied embedding is kept as it is, stored once, and the stream is rotated by a run-time
  matrix after the embedding and back before the final norm (TICO's way); Gemma 2/3 norm each block's output
  after its projection, so those outputs are rotated at run time too (:class:`models.decoder.Rotation`).
- **R2**, per attention head: ``v_proj``'s rows and ``o_proj``'s columns of each head by one head_dim
  rotation (attention mixes positions, not features: ``P (V Q) = (P V) Q``).
- **R4** (``quant.online_hadamard``): a Hadamard transform of ``down_proj``'s input at run time (the SwiGLU
  product has the worst outliers, and no weight before it can absorb a rotation), ``down_proj`` rotated to match.

**Massive activations.** Some models carry a few residual channels hundreds of times larger than the rest on some
tokens (SmolLM2-135M's channel 507 reaches 25000 where the median channel's peak is 82), and the norms after them
nearly zero those channels' gains. Rotated, such a channel would be spread over every channel, and every weight's
rounding error would multiply it: measured on SmolLM2, a full R1 took 8da4w (HQQ) from +38% to +92% perplexity
on unseen text. So with data-free rounding the channels whose peak on the calibration text exceeds
``MASSIVE_RATIO`` times the median channel's stay where they are, with their norm gains (R1 rotates the others).
GPTQ needs no such care: its error compensation weighs each input by its energy, the massive channel's first, and
it does better with every channel rotated (SmolLM2 per-channel 4-bit: +15.7% against +44% with those channels
kept; docs/quality.md#rotations).

Each rotation is computed in float64 and stored in the weights' dtype: in fp32 the rotated model computes what
the plain one does to float noise (tests/test_rotation.py, every family). LoRA adapters turn with their layers:
``A`` as the layer's inputs, ``B`` as its outputs.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from exporters.config import QuantConfig, RotationKind
from exporters.errors import UserError
from exporters.manifest import RotationRecord
from exporters.quant.calibration import CalibrationText, LayerByLayer
from exporters.quant.hadamard import ONLINE_LARGEST, factors, hadamard_factors, random_rotation
from models.decoder import CausalLM, Norms, RMSNorm, Rotation

# A residual channel whose peak |activation| on the calibration text exceeds this many times the median channel's
# peak is "massive" and kept out of R1 (SmolLM2-135M: 3 channels at 24-300x; the next is at 11x).
MASSIVE_RATIO = 16.0
# Calibration tokens read to find them (the peaks show on the first few hundred tokens).
MASSIVE_TOKENS = 1024


def _parts(module: nn.Module) -> tuple[nn.Linear, list[nn.Linear], list[nn.Linear]]:
    """A linear's base layer and, if PEFT wrapped it, its adapters' A and B matrices."""
    base = getattr(module, "base_layer", module)
    lora_a = list(getattr(module, "lora_A", {}).values())
    lora_b = list(getattr(module, "lora_B", {}).values())
    return base, lora_a, lora_b


def _assign(param: nn.Parameter | torch.Tensor, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype)


def _inputs(module: nn.Module, m: torch.Tensor) -> None:
    """``W -> W M`` for the layer and its adapters' A, ``M`` [k, k] applied to each block of k inputs."""
    base, lora_a, _ = _parts(module)
    for linear in (base, *lora_a):
        w = linear.weight.detach().double()
        _assign(linear.weight, (w.view(w.shape[0], -1, m.shape[0]) @ m).view_as(w))


def _outputs(module: nn.Module, n: torch.Tensor, rows: slice = slice(None)) -> None:
    """``W -> N W`` (and the bias) for the layer and its adapters' B, ``N`` [k, k] applied to each block of k of
    the output ``rows``."""
    base, _, lora_b = _parts(module)
    for linear in (base, *lora_b):
        w = linear.weight.detach().double()
        part = w[rows]
        w[rows] = (n @ part.reshape(-1, n.shape[0], part.shape[1])).reshape_as(part)
        _assign(linear.weight, w)
        if linear.bias is not None:
            b = linear.bias.detach().double()
            b[rows] = (b[rows].view(-1, n.shape[0]) @ n.T).reshape(-1)
            _assign(linear.bias, b)


def _fold_gain(norm: RMSNorm, readers: list[nn.Module], q: torch.Tensor, kept: torch.Tensor) -> None:
    """The linears reading ``norm`` turned by R1 ``q`` with the norm's gain moved into them (``W diag(g) Q``, one
    matmul), but on the ``kept`` channels (which R1 leaves in place, so their gain commutes with it): the norm is
    left scaling the others by one."""
    offset = 1.0 if norm.unit_offset else 0.0
    gain = norm.weight.detach().double() + offset
    gain[kept] = 1.0
    for reader in readers:
        _inputs(reader, gain[:, None] * q)
    weight = torch.full_like(norm.weight, 1.0 - offset)
    weight[kept] = norm.weight.detach()[kept]
    norm.weight.data = weight


@torch.no_grad()
def massive_channels(model: CausalLM, text: CalibrationText) -> tuple[list[int], float]:
    """The residual channels whose peak |activation| (entering any layer, or the final norm) on up to
    MASSIVE_TOKENS of ``text`` exceeds MASSIVE_RATIO times the median channel's peak, largest first, and the
    largest ratio."""
    run = LayerByLayer(model, text.first(MASSIVE_TOKENS))  # the layers alone: no logits over the vocabulary
    peaks = torch.zeros(model.args.hidden_size, dtype=torch.float64)
    states = run.embedded
    for i in range(len(model.model.layers) + 1):
        for h in states:
            peaks = torch.maximum(peaks, h.detach().abs().reshape(-1, peaks.numel()).amax(0).double())
        if i < len(model.model.layers):
            states = run.layer(i, states)
    model.reset_cache()
    ratio = peaks / peaks.median().clamp_min(1e-12)
    order = torch.argsort(ratio, descending=True)
    return [int(c) for c in order if ratio[c] > MASSIVE_RATIO], float(ratio[order[0]])


def _readers(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The linears reading the attention's and the MLP's normed inputs."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [attn.qkv_proj] if hasattr(attn, "qkv_proj") else [attn.q_proj, attn.k_proj, attn.v_proj]
    gate_up = [mlp.gate_up_proj] if hasattr(mlp, "gate_up_proj") else [mlp.gate_proj, mlp.up_proj]
    return qkv, gate_up


def check_online_hadamard(intermediate_size: int) -> tuple[int, ...]:
    """The factors of the online R4 transform for this width, or a UserError saying why there are none."""
    orders = factors(intermediate_size)
    if orders is None or max(orders) > ONLINE_LARGEST:
        raise UserError(
            f"quant.online_hadamard=true: no Hadamard transform of the MLP's width {intermediate_size} factors into "
            f"pieces of at most {ONLINE_LARGEST} (found {orders}), so it would cost about as much as down_proj itself. "
            "Use quant.online_hadamard=false (quant.rotation=hadamard still rotates the weights).")
    return orders


def rotates(quant: QuantConfig) -> bool:
    """Whether ``quant`` rotates the model (R1 and R2, or R4 alone)."""
    return quant.rotation != RotationKind.none or quant.online_hadamard


def check_rotation(shapes: CausalLM, quant: QuantConfig) -> None:
    """What a rotation needs of the model's shapes, checked before any weight is read."""
    if quant.rotation_steps is not None and (quant.rotation != RotationKind.learned or quant.rotation_steps < 1):
        raise UserError(f"quant.rotation_steps={quant.rotation_steps}: the steps of quant.rotation=learned (at least 1; "
                        f"null = the default), and quant.rotation={quant.rotation}. Use quant.rotation=learned with "
                        "it, or drop quant.rotation_steps.")
    if quant.rotation == RotationKind.learned:
        if shapes.args.norms != Norms.pre:
            raise UserError("quant.rotation=learned learns the rotations of pre-norm decoders (Llama, Qwen, SmolLM, "
                            "Mistral, Phi-3), and this model norms its blocks' outputs after their projections (part "
                            "of R1 then runs at run time, which learning does not model). Use quant.rotation=hadamard.")
        if quant.linear is None:
            raise UserError(f"quant.rotation=learned learns rotations for the linear layers' integer grid, and "
                            f"quant={quant.name} has no integer linears (quant.linear is null). Use quant=8da4w_rotated "
                            f"quant.rotation=learned, or quant.rotation=hadamard.")
    if rotates(quant) and shapes.args.per_layer_shapes:
        raise UserError("quant.rotation and quant.online_hadamard rotate every layer alike, and this model's layers "
                        "differ in head size, kv heads, MLP width or cache (Gemma 4). Export it without them "
                        "(quant.rotation=none quant.online_hadamard=false).")
    if quant.online_hadamard:
        check_online_hadamard(shapes.args.intermediate_size)


def _residual(model: CausalLM, q: torch.Tensor, kept: torch.Tensor, keep_tied: bool, record: RotationRecord) -> None:
    """R1: the residual stream rotated by ``q`` [hidden, hidden] (rows are features: ``h -> h Q``), which leaves the
    ``kept`` channels in place."""
    body, a = model.model, model.args
    for layer in body.layers:
        qkv, gate_up = _readers(layer)
        if a.norms == Norms.post:  # OLMo: the residual stream goes into the projections unnormed, no gain to fold
            for reader in (*qkv, *gate_up):
                _inputs(reader, q)
        else:
            _fold_gain(layer.input_layernorm, qkv, q, kept)
            _fold_gain(layer.pre_feedforward_layernorm if a.norms == Norms.sandwich else layer.post_attention_layernorm,
                       gate_up, q, kept)
        if a.norms == Norms.pre:
            _outputs(layer.self_attn.o_proj, q.T)
            _outputs(layer.mlp.down_proj, q.T)
    if a.norms != Norms.pre:  # each block's output is normed after its projection: rotated once normed, at run time
        shared = q.T.float().contiguous()
        for layer in body.layers:
            layer.output_rotation = Rotation([shared])
        record.online.append(f"each block's normed output ({q.shape[0]}x{q.shape[0]}, 2 per layer)")
    if keep_tied:
        model.embed_rotation, model.norm_rotation = Rotation([q.T.float().contiguous()]), Rotation([q.float()])
        record.online.append(f"the tied embedding's output and the final norm's input ({q.shape[0]}x{q.shape[0]} each)")
    else:
        _inputs(body.embed_tokens, q)
        _fold_gain(body.norm, [model.lm_head], q, kept)


def _heads(model: CausalLM, q2: torch.Tensor) -> None:
    """R2: each head's values rotated by ``q2`` [head_dim, head_dim], and o_proj's inputs to match."""
    a = model.args
    values = slice((a.num_attention_heads + a.num_key_value_heads) * a.head_dim, None) if a.fused_qkv else slice(None)
    for layer in model.model.layers:
        attn = layer.self_attn
        _outputs(attn.qkv_proj if a.fused_qkv else attn.v_proj, q2.T, values)
        _inputs(attn.o_proj, q2)


def _down_inputs(model: CausalLM) -> None:
    """R4: every down_proj reads its input through one normalized Hadamard transform H; its weights become ``W H^T``."""
    parts = hadamard_factors(model.args.intermediate_size)
    assert parts is not None, "check_online_hadamard ran first"
    parts = [p / p.shape[0] ** 0.5 for p in parts]
    exact, stored = Rotation(parts), [p.float() for p in parts]  # float64 for the weights; one fp32 copy at run time
    for layer in model.model.layers:
        mlp = layer.mlp
        base, lora_a, _ = _parts(mlp.down_proj)
        for linear in (base, *lora_a):  # each row of W transformed as an input is: (H w^T)^T = w H^T
            w = linear.weight.detach().double()
            _assign(linear.weight, exact(w[None]).view_as(w))
        mlp.down_input_rotation = Rotation(stored)


def _around(d: int, kept: list[int], seed: int) -> tuple[torch.Tensor, str]:
    """An orthogonal [d, d] rotation of every channel but ``kept``, which it leaves in place."""
    rest = torch.tensor([c for c in range(d) if c not in set(kept)])
    inner, what = random_rotation(len(rest), seed)
    q = torch.eye(d, dtype=torch.float64)
    q[rest[:, None], rest[None, :]] = inner
    return q, what + (f"; {len(kept)} massive channel(s) kept in place" if kept else "")


# Learns R1 and R2 from the Hadamard start (exporters.quant.learned_rotation): the learned pair and what the manifest
# says of the learning.
Learner = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, str]]


@torch.no_grad()
def rotate(model: CausalLM, residual_and_heads: bool, online_hadamard: bool, keep_tied: bool,
           massive_in: CalibrationText | None = None, seed: int = 0, learn: Learner | None = None) -> RotationRecord:
    """Rotate ``model`` in place; ``keep_tied``: its embedding is tied to lm_head and stays one matrix;
    ``massive_in``: the text to find massive activations in, which R1 then leaves in place (None: every channel
    is rotated, as for GPTQ); ``learn``: R1 and R2 learned from the Hadamard ones (R4 first, so they are learned with
    it: it turns down_proj's inputs, R1 its outputs)."""
    started = time.perf_counter()
    a = model.args
    record = RotationRecord(residual=None, heads=None, seed=seed)
    orders = check_online_hadamard(a.intermediate_size) if online_hadamard else ()
    if online_hadamard and learn is not None:
        _down_inputs(model)
    if residual_and_heads:
        if massive_in is not None:
            record.massive_channels, record.massive_ratio = massive_channels(model, massive_in)
        kept = record.massive_channels
        q, record.residual = _around(a.hidden_size, kept, seed)
        q2, record.heads = random_rotation(a.head_dim, seed + 1)
        if learn is not None:
            q, q2, learned = learn(q, q2)
            record.residual, record.heads = f"{learned}, from {record.residual}", f"learned, from {record.heads}"
        _residual(model, q, torch.tensor(kept, dtype=torch.long), keep_tied, record)
        _heads(model, q2)
    if online_hadamard:
        if learn is None:
            _down_inputs(model)
        record.online.append(f"down_proj's input: Hadamard {a.intermediate_size} ({' x '.join(map(str, orders))})")
    record.seconds = round(time.perf_counter() - started, 1)
    return record
