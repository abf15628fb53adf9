"""Swappable LoRA (``export.adapters=swappable``): the base's methods read their adapter from state an app writes.

A LoRA adapter adds ``scale * B(A(x))`` to each linear layer it targets (``models.lora``). Here every targeted kind
of layer (``q_proj``, ``v_proj``, ...) gets, in every decoder layer, two buffers: ``Aᵀ`` ``[1, in, rank]`` and
``(scale·B)ᵀ`` ``[1, rank, out]``, zero-padded to the program's rank. The base's methods add ``x @ Aᵀ @ (scale·B)ᵀ``
to each such layer's output; the method ``set_adapter`` takes each kind's matrices for all layers at once
(``[layers, 1, in, rank]``, ``[layers, 1, rank, out]``) and copies them into the buffers, which every method shares
by name as it shares the KV cache. All zeros is the base, exactly
(the sum adds 0.0). Any PEFT adapter whose targets and ranks fit is then data: :func:`pack` lays it out.

Why state and not method inputs: the stock runners call the methods with tokens and a position only, and a swap is
one call copying a few MB (measured in docs/adapters.md) instead of reloading a program. How the state is read is
decided by two ExecuTorch behaviours (:meth:`LoraSlots.keep_live`): a buffer a method only reads becomes one of its
constants, which XNNPACK would pack; a buffer the method writes is state, handed to the delegate at run time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from models.errors import ModelError

SET_ADAPTER = "set_adapter"
INT8 = "int8"  # SlotGeometry.stored: the adapter's matrices in 8 bits
SCALE = ".scale"  # an 8-bit matrix's scales: <kind>.A.scale
# The module path of each decoder layer's linear layers: model.layers.<layer>.<block>.<kind>.
LAYER_LINEAR = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>[a-z_]+)\.(?P<kind>[a-z_]+)$")


class SlotError(ModelError):
    """An adapter that does not fit the program's slots (rank, targets, shapes, base)."""


@dataclasses.dataclass(frozen=True)
class SlotTarget:
    """One kind of linear layer with a slot in every decoder layer."""

    kind: str  # q_proj
    block: str  # self_attn: its path is model.layers.<layer>.<block>.<kind> ("" when read from a program)
    in_features: int
    out_features: int

    def path(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.{self.kind}"


@dataclasses.dataclass(frozen=True)
class SlotGeometry:
    """The shapes an adapter must fit: decided once in the plan, recorded in the manifest, read by apps.

    ``dtype`` is the slots' (the activations' dtype, in which the products are computed); ``stored`` is the dtype of
    the matrices ``set_adapter`` takes and adapter files hold: the slots' own, or ``int8`` codes with one float scale
    per row of A and of ``scale·B`` (``<kind>.A.scale`` ``[layers, 1, 1, rank]``, ``<kind>.B.scale``
    ``[layers, 1, 1, out]``), which ``set_adapter`` multiplies back into the slots: a quarter of the bytes to ship and
    to set, the same computation per token."""

    layers: int
    rank: int
    targets: tuple[SlotTarget, ...]
    dtype: str = "float32"
    stored: str = "float32"

    @property
    def quantized(self) -> bool:
        return self.stored == INT8

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        """``set_adapter``'s inputs, in order, as an adapter file names them (``q_proj.A``, ``q_proj.B``, ... and,
        stored in 8 bits, each one's ``.scale`` after it), with their shapes: ``[layers, 1, in, rank]`` and
        ``[layers, 1, rank, out]`` (the 1: a layer's slice is the batch of one that ``bmm`` takes, with no reshape
        between the slot and the matmul)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for t in self.targets:
            for part, shape in (("A", (self.layers, 1, t.in_features, self.rank)),
                                ("B", (self.layers, 1, self.rank, t.out_features))):
                shapes[f"{t.kind}.{part}"] = shape
                if self.quantized:  # one scale per column of Aᵀ (row of A) and of (scale·B)ᵀ (row of scale·B)
                    shapes[f"{t.kind}.{part}{SCALE}"] = (*shape[:2], 1, shape[-1])
        return shapes

    def input_names(self) -> list[str]:
        return list(self.input_shapes())

    def input_dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.dtype if name.endswith(SCALE) or not self.quantized else self.stored)

    @staticmethod
    def of_inputs(names: list[str], shapes: list[tuple[int, ...]], dtypes: list[torch.dtype]) -> "SlotGeometry":
        """The slots as a program's ``set_adapter`` takes them (its inputs' names, shapes, dtypes): what an app knows."""
        inputs = {n: (shape, dtype) for n, shape, dtype in zip(names, shapes, dtypes, strict=True)}
        targets = [SlotTarget(n.removesuffix(".A"), "", shape[-2], inputs[n.removesuffix("A") + "B"][0][-1])
                   for n, (shape, _) in inputs.items() if n.endswith(".A")]
        a_shape, a_dtype = inputs[names[0]]  # the first target's A: inputs start with it (input_shapes)
        slots_dtype = inputs[names[0] + SCALE][1] if names[0] + SCALE in inputs else a_dtype
        return SlotGeometry(a_shape[0], a_shape[-1], tuple(targets), str(slots_dtype).removeprefix("torch."),
                            str(a_dtype).removeprefix("torch."))

    def zeros(self) -> dict[str, torch.Tensor]:
        """The base model's adapter: every slot zero (scales of one)."""
        return {name: (torch.ones if name.endswith(SCALE) else torch.zeros)(shape, dtype=self.input_dtype(name))
                for name, shape in self.input_shapes().items()}

    def bytes(self) -> int:
        """The slots' state in the program."""
        per_layer = sum(t.in_features + t.out_features for t in self.targets) * self.rank
        return self.layers * per_layer * getattr(torch, self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "rank": self.rank, "dtype": self.dtype, "stored": self.stored,
                "targets": [{"kind": t.kind, "block": t.block, "in_features": t.in_features,
                             "out_features": t.out_features} for t in self.targets]}

    def describe(self) -> str:
        stored = f", set from {self.stored} matrices with a scale per row" if self.quantized else ""
        return (f"rank {self.rank} on {', '.join(t.kind for t in self.targets)} of {self.layers} layers "
                f"({self.bytes() / 1e6:.2f} MB of {self.dtype} state{stored})")


def _layer_linears(model: nn.Module) -> Iterator[tuple[re.Match[str], nn.Linear]]:
    """The decoder layers' linear layers (PEFT's wrapper of one counts as it), with their path's parts."""
    for path, module in model.named_modules():
        match = LAYER_LINEAR.match(path)
        linear = getattr(module, "base_layer", module)  # a PEFT LoraLayer wraps the linear as base_layer
        if match is not None and isinstance(linear, nn.Linear):
            yield match, linear


def slot_geometry(model: nn.Module, kinds: list[str], rank: int, dtype: torch.dtype = torch.float32,
                  stored: str | None = None) -> SlotGeometry:
    """The slots for ``kinds`` of ``model``'s decoder layers (our decoder, or its shapes on the meta device);
    ``stored="int8"``: set from 8-bit matrices (:class:`SlotGeometry`)."""
    found: dict[str, SlotTarget] = {}
    layers = 0
    for match, module in _layer_linears(model):
        layers = max(layers, int(match["layer"]) + 1)
        kind = match["kind"]
        if kind in kinds:
            target = SlotTarget(kind, match["block"], module.in_features, module.out_features)
            if found.setdefault(kind, target) != target:
                raise SlotError(f"export.lora_targets: {kind} differs between layers ({found[kind]} and {target}); "
                                "a swappable slot needs one shape for every layer. Leave it out of export.lora_targets.")
    missing = [k for k in kinds if k not in found]
    if missing:
        have = sorted({m["kind"] for m, _ in _layer_linears(model)})
        raise SlotError(f"export.lora_targets names {', '.join(missing)}, which this model's decoder layers do not "
                        f"have. Allowed: {', '.join(have)}.")
    if rank < 1:
        raise SlotError(f"export.lora_max_rank={rank}: give the largest rank an adapter may have (1 or more).")
    name = str(dtype).removeprefix("torch.")
    return SlotGeometry(layers, rank, tuple(found[k] for k in kinds), name, stored or name)


class LoraSlots(nn.Module):
    """The slots' buffers, one pair per targeted layer (``lora_slots.<kind>_A_<layer>`` ``[1, in, rank]`` and
    ``..._B_<layer>`` ``[1, rank, out]``), and the ``set_adapter`` computation."""

    def __init__(self, geometry: SlotGeometry) -> None:
        super().__init__()
        self.geometry = geometry
        dtype = getattr(torch, geometry.dtype)
        for t in geometry.targets:
            for layer in range(geometry.layers):
                self.register_buffer(f"{t.kind}_A_{layer}", torch.zeros(1, t.in_features, geometry.rank, dtype=dtype))
                self.register_buffer(f"{t.kind}_B_{layer}", torch.zeros(1, geometry.rank, t.out_features, dtype=dtype))

    def delta(self, kind: str, layer: int, x: torch.Tensor) -> torch.Tensor:
        """``x @ Aᵀ @ (scale·B)ᵀ`` of ``kind`` in ``layer``, x ``[1, T, in]`` as the decoder's layers take it: the
        slot's buffers go into XNNPACK's ``bmm`` as they are, runtime inputs of the delegate (module docstring), with
        nothing computed outside the delegate in between (which would cut the layer's partition in pieces)."""
        return torch.bmm(torch.bmm(x, getattr(self, f"{kind}_A_{layer}")), getattr(self, f"{kind}_B_{layer}"))

    def keep_live(self) -> None:
        """Write one row of each slot with its own value, once per call before the first layer. A method that only
        reads a buffer gets it folded into its constants by ExecuTorch's constant propagation, and XNNPACK packs a
        constant it reads as its own; a buffer the method writes is state, shared by name across methods as the KV
        cache is, and reaches the delegate as a runtime input. The write is an in-place ``index_put`` of one row (one
        index tensor, on the middle dimension: what ExecuTorch's in-place kernel takes), ``rank`` or ``out`` numbers,
        read with ``index_select``: no op of the write is one XNNPACK delegates, which would tie the write into a
        layer's partition and cut it."""
        zero = torch.zeros(1, dtype=torch.long)
        for buffer in self.buffers():
            torch.ops.aten.index_put_.default(buffer, [None, zero], buffer.index_select(1, zero))

    def set_adapter(self, *tensors: torch.Tensor) -> torch.Tensor:
        """Copy an adapter (tensors in :meth:`SlotGeometry.input_names` order, each ``[layers, 1, ...]``) into the
        slots, layer by layer (8-bit codes times their scales); gives the rank."""
        given = dict(zip(self.geometry.input_names(), tensors, strict=True))
        for name, tensor in given.items():
            if name.endswith(SCALE):
                continue
            if self.geometry.quantized:
                tensor = tensor.to(getattr(torch, self.geometry.dtype)) * given[name + SCALE]
            for layer in range(self.geometry.layers):
                getattr(self, f"{name.replace('.', '_')}_{layer}").copy_(tensor[layer])
        return torch.tensor([self.geometry.rank], dtype=torch.int64)

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Eagerly, what ``set_adapter`` does in the program."""
        with torch.no_grad():
            self.set_adapter(*(tensors[n] for n in self.geometry.input_names()))


def _add_delta(slots: LoraSlots, kind: str, layer: int, module: nn.Module, args: tuple[Any, ...],
               out: torch.Tensor) -> torch.Tensor:
    return out + slots.delta(kind, layer, args[0])


def _keep_live(slots: LoraSlots, module: nn.Module, args: tuple[Any, ...]) -> None:
    slots.keep_live()  # once per call, before the first layer: nothing of the model runs before it


class SlottedLinear(nn.Linear):
    """A linear layer whose forward hook adds its LoRA slot's product: a type of its own, because XNNPACK's
    ``ConvertToLinearPass`` gathers every op traced inside an ``nn.Linear`` call as that layer's and expects one
    output, and the hook's matmuls are traced inside the call. Everything else (torchao's quantization, PEFT)
    sees the ``nn.Linear`` it is."""


def attach_slots(model: nn.Module, geometry: SlotGeometry) -> LoraSlots:
    """Give ``model`` the slots (as ``model.lora_slots``) and make each targeted layer add its slot's product."""
    slots = LoraSlots(geometry)
    model.add_module("lora_slots", slots)
    model.register_forward_pre_hook(functools.partial(_keep_live, slots))
    for target in geometry.targets:
        for layer in range(geometry.layers):
            module = model.get_submodule(target.path(layer))
            if type(module) is nn.Linear:  # a PEFT layer wrapping it is a type of its own already
                module.__class__ = SlottedLinear
            module.register_forward_hook(functools.partial(_add_delta, slots, target.kind, layer))
    return slots


@contextlib.contextmanager
def capturing_set_adapter(model: nn.Module) -> Iterator[tuple[torch.Tensor, ...]]:
    """Within this block ``model(*inputs)`` is ``set_adapter``: how the method is captured from the same module, so
    its buffers have the names the decoder's methods read. Yields example inputs (zeros)."""
    slots: LoraSlots = model.get_submodule("lora_slots")  # type: ignore[assignment]
    model.forward = slots.set_adapter  # type: ignore[method-assign]
    try:
        yield tuple(slots.geometry.zeros().values())
    finally:
        del model.forward


def _scale(config: Any, path: str, rank: int) -> float:
    """PEFT's scaling of one layer: ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), alpha per layer by pattern."""
    from peft.utils.other import get_pattern_key

    alphas = config.alpha_pattern or {}
    alpha = alphas.get(get_pattern_key(alphas.keys(), path), config.lora_alpha) if alphas else config.lora_alpha
    return alpha / math.sqrt(rank) if config.use_rslora else alpha / rank


def pack(name: str, config: Any, modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
         geometry: SlotGeometry) -> dict[str, torch.Tensor]:
    """A PEFT adapter (``modules``: module path -> its (A [r, in], B [out, r])) laid out in ``geometry``'s slots:
    ``Aᵀ`` and ``(scale·B)ᵀ`` zero-padded to the slots' rank, zeros where it targets nothing. Refuses, naming the
    adapter and the fix, what does not fit."""
    tensors = dataclasses.replace(geometry, stored=geometry.dtype).zeros()  # the matrices before any rounding
    kinds = {t.kind: t for t in geometry.targets}
    by_path = {}
    for path in modules:
        match = LAYER_LINEAR.match(path)
        if match is not None and match["kind"] in kinds and int(match["layer"]) < geometry.layers:
            by_path[path] = (kinds[match["kind"]], int(match["layer"]))
    outside = sorted(p for p in modules if p not in by_path)
    if outside:
        missing = sorted({p.rsplit(".", 1)[-1] for p in outside})
        raise SlotError(f"adapter {name} targets {', '.join(missing)} (e.g. {outside[0]}), and the program's slots are "
                        f"{geometry.describe()}. Export the program again with export.lora_targets including "
                        f"{', '.join(missing)}, or train the adapter on those targets only.")
    for path, (a, b) in modules.items():
        target, layer = by_path[path]
        rank = a.shape[0]
        if rank > geometry.rank:
            raise SlotError(f"adapter {name} has rank {rank} on {path}, above the program's export.lora_max_rank="
                            f"{geometry.rank}. Export the program again with export.lora_max_rank={rank} or more, "
                            f"or train the adapter with r<={geometry.rank}.")
        if tuple(a.shape) != (rank, target.in_features) or tuple(b.shape) != (target.out_features, rank):
            raise SlotError(f"adapter {name}: {path} has A {list(a.shape)} and B {list(b.shape)}; the program's layer "
                            f"is {target.out_features} x {target.in_features}. The adapter was trained for another "
                            "base model: train it on this program's base.")
        scaled = b.float() * _scale(config, path, rank)
        tensors[f"{target.kind}.A"][layer, 0, :, :rank] = a.float().t()
        tensors[f"{target.kind}.B"][layer, 0, :rank, :] = scaled.t()
    return _quantized(tensors, geometry) if geometry.quantized else tensors


def _quantized(tensors: dict[str, torch.Tensor], geometry: SlotGeometry) -> dict[str, torch.Tensor]:
    """Each matrix as int8 codes and a float scale per column of Aᵀ / (scale·B)ᵀ (per row of A and of scale·B):
    symmetric, the largest magnitude to 127. (The methods mode's ``quant.adapters`` quantizes PEFT's layers with
    torchao and HQQ instead; here the codes are what an app's file holds, made without torchao.)"""
    out = {}
    for name in geometry.input_names():
        if name.endswith(SCALE):
            continue
        matrix = tensors[name]
        scale = matrix.abs().amax(dim=-2, keepdim=True) / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an unused column: codes 0, scale 1
        out[name] = torch.round(matrix / scale).clamp(-127, 127).to(torch.int8)
        out[name + SCALE] = scale.to(geometry.input_dtype(name + SCALE))
    return out
