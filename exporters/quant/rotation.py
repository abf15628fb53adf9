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

Each rotation is computed in float64 and stored in the weights' dtype: in fp32 the rotated model computes what
the plain one does to float noise (tests/test_rotation.py, every family). LoRA adapters turn with their layers:
``A`` as the layer's inputs, ``B`` as its outputs.
"""

from __future__ import annotations

import time
import torch
from torch import nn

from exporters.config import QuantConfig
from exporters.errors import UserError
from exporters.manifest import RotationRecord
from exporters.quant.hadamard import ONLINE_LARGEST, factors, hadamard_factors, random_rotation
from models.decoder import CausalLM, RMSNorm, Rotation


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


def _fold_gain(norm: RMSNorm, readers: list[nn.Module]) -> None:
    """Move ``norm``'s gain into the linears that read it (``W diag(g)``); the norm is left scaling by one."""
    gain = norm.weight.detach().double() + (1.0 if norm.unit_offset else 0.0)
    for reader in readers:
        _inputs(reader, torch.diag(gain))
    norm.weight.data.fill_(0.0 if norm.unit_offset else 1.0)


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


def check_rotation(shapes: CausalLM, quant: QuantConfig) -> None:
    """What a rotation needs of the model's shapes, checked before any weight is read."""
    if quant.online_hadamard:
        check_online_hadamard(shapes.args.intermediate_size)


def _residual(model: CausalLM, q: torch.Tensor, keep_tied: bool, record: RotationRecord) -> None:
    """R1: the residual stream rotated by ``q`` [hidden, hidden] (rows are features: ``h -> h Q``)."""
    body, a = model.model, model.args
    for layer in body.layers:
        qkv, gate_up = _readers(layer)
        _fold_gain(layer.input_layernorm, qkv)
        _fold_gain(layer.pre_feedforward_layernorm if a.sandwich_norms else layer.post_attention_layernorm, gate_up)
        for reader in qkv + gate_up:
            _inputs(reader, q)
        if not a.sandwich_norms:
            _outputs(layer.self_attn.o_proj, q.T)
            _outputs(layer.mlp.down_proj, q.T)
    if a.sandwich_norms:  # each block's output is normed after its projection: rotated once normed, at run time
        shared = q.T.float().contiguous()
        for layer in body.layers:
            layer.output_rotation = Rotation([shared])
        record.online.append(f"each block's normed output ({q.shape[0]}x{q.shape[0]}, 2 per layer)")
    if keep_tied:
        model.embed_rotation, model.norm_rotation = Rotation([q.T.float().contiguous()]), Rotation([q.float()])
        record.online.append(f"the tied embedding's output and the final norm's input ({q.shape[0]}x{q.shape[0]} each)")
    else:
        _inputs(body.embed_tokens, q)
        _fold_gain(body.norm, [model.lm_head])
        _inputs(model.lm_head, q)


def _heads(model: CausalLM, q2: torch.Tensor) -> None:
    """R2: each head's values rotated by ``q2`` [head_dim, head_dim], and o_proj's inputs to match."""
    a = model.args
    values = slice((a.num_attention_heads + a.num_key_value_heads) * a.head_dim, None) if a.fused_qkv else slice(None)
    for layer in model.model.layers:
        attn = layer.self_attn
        _outputs(attn.qkv_proj if a.fused_qkv else attn.v_proj, q2.T, values)
        _inputs(attn.o_proj, q2)


def _down_inputs(model: CausalLM, orders: tuple[int, ...]) -> None:
    """R4: every down_proj reads its input through one normalized Hadamard transform H; its weights become ``W H^T``."""
    parts = hadamard_factors(model.args.intermediate_size)
    assert parts is not None and tuple(p.shape[0] for p in parts) == orders
    parts = [p / p.shape[0] ** 0.5 for p in parts]
    exact, stored = Rotation(parts), [p.float() for p in parts]  # float64 for the weights; one fp32 copy at run time
    for layer in model.model.layers:
        mlp = layer.mlp
        base, lora_a, _ = _parts(mlp.down_proj)
        for linear in (base, *lora_a):  # each row of W transformed as an input is: (H w^T)^T = w H^T
            w = linear.weight.detach().double()
            _assign(linear.weight, exact(w[None]).view_as(w))
        mlp.down_input_rotation = Rotation(stored)


@torch.no_grad()
def rotate(model: CausalLM, residual_and_heads: bool, online_hadamard: bool, keep_tied: bool,
           seed: int = 0) -> RotationRecord:
    """Rotate ``model`` in place; ``keep_tied``: its embedding is tied to lm_head and stays one matrix."""
    started = time.perf_counter()
    a = model.args
    record = RotationRecord(residual=None, heads=None, seed=seed)
    orders = check_online_hadamard(a.intermediate_size) if online_hadamard else ()
    if residual_and_heads:
        q, record.residual = random_rotation(a.hidden_size, seed)
        _residual(model, q, keep_tied, record)
        q2, record.heads = random_rotation(a.head_dim, seed + 1)
        _heads(model, q2)
    if online_hadamard:
        _down_inputs(model, orders)
        record.online.append(f"down_proj's input: Hadamard {a.intermediate_size} ({' x '.join(map(str, orders))})")
    record.seconds = round(time.perf_counter() - started, 1)
    return record

