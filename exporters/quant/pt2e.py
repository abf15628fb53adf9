"""PT2E quantization: a backend's own quantizer on the captured graph, as ExecuTorch documents it.

The model is captured once as the prompt method (any number of tokens), the backend's quantizer annotates
the graph (``prepare_pt2e``), the graph runs the calibration text the way the program will be run (each
window's prompt at once, then single tokens) so static activation observers see real ranges, and
``convert_pt2e`` folds each weight into its integer form. Every method is then captured from that one converted
module (``exporters.stages.capture``): all methods read the very same quantized weights (the backend stores
them once) and the same activation scales.

Only the linear layers are quantized; the token embedding keeps ``quant.embedding`` (torchao's, applied before
capture). Names follow ExecuTorch's export_llm (``quantization.pt2e_quantize``).
"""

from __future__ import annotations

import time
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import torch

from exporters.backends import PT2E_RECIPES, Pt2eRecipe
from exporters.config import Algorithm, Pt2eQuantizer
from exporters.errors import UserError, listed
from exporters.manifest import CalibrationRecord, Pt2eRecord
from exporters.program.internals import pt2e_annotation_key
from exporters.quant.calibration import check_calibration
from models.decoder import is_constant_matrix

if TYPE_CHECKING:
    from exporters.config import BackendConfig, QuantConfig
    from exporters.program.methods import MethodSpec
    from exporters.quant.calibration import CalibrationText
    from models.decoder import CausalLM

# Why static activations are refused (measured 2026-11-27, docs/quality.md): the numbers the refusal quotes.
FIRST_TOKEN_PEAK = "layer 11's down_proj input peaks at 2864 at position 0, 16 at every other position"
STATIC_REMEDY = ("an NPU that needs static activations wants 16-bit ones (Qualcomm's QNN recipe, 16a4w), a backend "
                 "this tool does not export to yet.")

# Single-token calls at the end of each calibration window: the decode method's inputs, after its prompt.
DECODE_STEPS = 16


def is_model_weight(node: torch.fx.Node) -> bool:
    """False for a linear that applies a constant matrix (RoPE's rotate_half, a rotation's online factor:
    ``models.decoder.is_constant_matrix``), exact in float: quantizing its input would only add error."""
    if node.target != torch.ops.aten.linear.default:
        return True
    weight = node.args[1]
    while isinstance(weight, torch.fx.Node) and weight.op == "call_function" and weight.args:  # .to(dtype)
        weight = weight.args[0]
    return not (isinstance(weight, torch.fx.Node) and is_constant_matrix(str(weight.target)))


def linears_only(inner: Any, outputs: bool = True) -> Any:
    """``inner``, a backend's quantizer, with its annotations kept on the model's own linear layers only (and
    with their outputs left in float unless ``outputs``).

    A backend quantizer annotates every op its kernels can take in int8: residual adds, norm multiplies, the
    int64 positions (coremltools' then fails to observe them), RoPE's constant rotation. A static scale on any of
    those costs an LLM far more than it saves; the linear layers hold the weights, and the bytes. An integer
    output must not cross a delegate's boundary (Core ML's takes no uint8 input, and the KV-cache update stays
    outside it), so backends whose linears take float outputs get them.
    """
    from torchao.quantization.pt2e.quantizer import Quantizer


    key = pt2e_annotation_key()

    class LinearsOnly(Quantizer):
        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return inner.transform_for_annotation(model)

        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            model = inner.annotate(model)
            for node in model.graph.nodes:
                if not (node.target == torch.ops.aten.linear.default and is_model_weight(node)):
                    node.meta.pop(key, None)
                elif not outputs and key in node.meta:
                    node.meta[key].output_qspec = None
            return model

        def validate(self, model: torch.fx.GraphModule) -> None:
            inner.validate(model)

        def __repr__(self) -> str:
            return f"LinearsOnly({type(inner).__name__})"

    return LinearsOnly()


#: Every backend's own PT2E quantizer, by its quant.pt2e name (each defined in its backend's module).
PT2E_QUANTIZERS: dict[Pt2eQuantizer, Pt2eRecipe] = PT2E_RECIPES


def check_pt2e(quant: QuantConfig, backend: BackendConfig, adapters: list[str]) -> None:
    """``quant.pt2e`` names a quantizer of ``backend``, and nothing else quantizes the linear layers."""

    if quant.pt2e is None:
        return
    recipe = PT2E_QUANTIZERS[quant.pt2e]
    if recipe.backend != backend.name:
        own = [str(name) for name, r in PT2E_QUANTIZERS.items() if r.backend == backend.name]
        raise UserError(
            f"quant.pt2e={quant.pt2e} is {recipe.backend}'s quantizer, and backend={backend.name} is chosen. "
            + (f"backend={backend.name}'s PT2E quantizers: {listed(own)} (quant=pt2e_<name>)."
               if own else f"backend={backend.name} has no PT2E quantizer; use a torchao scheme (quant=8da4w, "
                           f"quant=8w, ...) or backend={recipe.backend}."))
    torchao = {"quant.linear": quant.linear, "quant.lm_head": quant.lm_head, "quant.adapters": quant.adapters,
               "quant.size_budget": quant.size_budget}
    taken = {key: value for key, value in torchao.items() if value is not None}
    if taken or quant.algorithm != Algorithm.hqq:
        named = ", ".join(f"{k}={v}" for k, v in taken.items()) or f"quant.algorithm={quant.algorithm}"
        raise UserError(
            f"quant.pt2e={quant.pt2e} quantizes the linear layers with {recipe.backend}'s own quantizer, and {named} "
            f"asks torchao to quantize them too. Use one or the other: the pt2e_* presets set quant.linear=null "
            f"(quant.embedding may still name a torchao scheme for the token embedding).")
    if str(quant.dtype) != "fp32":
        raise UserError(f"quant.pt2e={quant.pt2e} with quant.dtype={quant.dtype}: the backends' quantizers annotate "
                        f"fp32 graphs. Use quant.dtype=fp32 (the backend may still compute in half precision).")
    if adapters:
        raise UserError(
            f"quant.pt2e={quant.pt2e} with model.adapters: each adapter's methods are captured with that adapter "
            f"switched on in the eager model, and a PT2E graph has no switch. Use a torchao scheme "
            f"(quant=8da4w, quant=8da8w) for a program with adapters.")
    if recipe.calibrated and not quant.allow_static_activations:
        raise UserError(
            f"quant.pt2e={quant.pt2e} gives every linear's input one int8 scale per tensor, and in a decoder LLM "
            f"that scale is set by the first token's massive activation (SmolLM2-135M: {FIRST_TOKEN_PEAK}): measured "
            f"on unseen text, SmolLM2-135M loses +831% perplexity, +165% with quant.rotation=hadamard "
            f"quant.online_hadamard=true (docs/quality.md#pt2e-the-backends-own-quantizers). For int8 activations use "
            f"quant=pt2e_xnnpack_dynamic (+1.4%) or quant=8da8w (+2.3%), one scale per token at run time; "
            f"{STATIC_REMEDY} To export it anyway (to study it, or to start quantization-aware training from it), "
            f"add quant.allow_static_activations=true.")
    if recipe.calibrated:
        check_calibration(quant.calibration)


def quantized_linears(graph: torch.fx.GraphModule) -> int:
    """Linear layers of a converted graph whose weight is dequantized from an integer constant."""
    def dequantizes(node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and "dequantize" in str(node.target)

    return sum(1 for n in graph.graph.nodes
               if n.op == "call_function" and n.target == torch.ops.aten.linear.default and dequantizes(n.args[1]))


def calibrate(prepared: torch.fx.GraphModule, windows: list[torch.Tensor], cache_buffers: list[str],
              max_tokens: int) -> int:
    """Each window (its first ``max_tokens``: the positions the prompt graph takes) from an empty cache as
    generation runs it: the prompt in one call, then its last ``DECODE_STEPS`` tokens one at a time (the
    decode method's single-token inputs). Returns the tokens run."""
    tokens = 0
    for window in windows:
        window = window[:, :max_tokens]
        for name in cache_buffers:
            prepared.get_buffer(name).zero_()
        split = max(1, window.shape[1] - DECODE_STEPS)
        prepared(window[:, :split], torch.tensor([0]))
        for i in range(split, window.shape[1]):
            prepared(window[:, i:i + 1], torch.tensor([i]))
        tokens += window.shape[1]
    return tokens


def one_quantize_per_reader(graph: torch.fx.GraphModule) -> int:
    """Give each dequantize of a static activation its own quantize (the same computation); returns how many
    were added. One quantize feeding q/k/v's three dequantizes puts a uint8 tensor across the boundary of a
    delegate that stops at the KV-cache update (Core ML's), which its converter cannot take as an input.
    ExecuTorch's DuplicateDynamicQuantChainPass does this for dynamic chains only."""
    added = 0
    for node in list(graph.graph.nodes):
        if node.op != "call_function" or "quantize_per_tensor" not in str(node.target) or "dequantize" in str(
                node.target):
            continue
        for reader in list(node.users)[1:]:
            with graph.graph.inserting_before(reader):
                copy = graph.graph.node_copy(node)
            reader.replace_input_with(node, copy)
            added += 1
    if added:
        graph.recompile()
    return added


def per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized to int8 and back with one asymmetric scale per token: what XNNPACK's dynamic linears
    compute (its qd8 operand), where PT2E's dynamic chain writes one scale per tensor."""
    ops = torch.ops.quantized_decomposed
    scale, zero_point = ops.choose_qparams_per_token_asymmetric(x, torch.int8)
    q = ops.quantize_per_token(x, scale, zero_point, -128, 127, torch.int8)
    return ops.dequantize_per_token(q, scale, zero_point, -128, 127, torch.int8, x.dtype)


def reference_graph(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of a converted graph computing what the backend computes, faster in PyTorch: validation's eager
    side. Each integer weight is dequantized once, ahead of time (validation steps the graphs through hundreds of
    single-token calls, and PyTorch would dequantize every weight at every call: 0.5 s a token on
    SmolLM2-135M); each dynamic activation chain gets one scale per token, as XNNPACK's kernels compute it
    (PT2E's reference writes one per tensor: a prompt of many tokens then differs, KL 0.05 on SmolLM2)."""
    import copy

    copied = copy.deepcopy(graph)
    for node in list(copied.graph.nodes):
        source = node.args[0] if node.args else None
        if (node.op == "call_function" and "dequantize_per_tensor.tensor" in str(node.target)
                and isinstance(source, torch.fx.Node) and "quantize_per_tensor.tensor" in str(source.target)):
            with copied.graph.inserting_before(node):
                fake = copied.graph.call_function(per_token, (source.args[0],))
            node.replace_all_uses_with(fake)
            copied.graph.erase_node(node)
    copied.graph.eliminate_dead_code()
    folded, inputs = 0, set()
    for node in list(copied.graph.nodes):
        if node.op != "call_function" or "dequantize_per_channel" not in str(node.target):
            continue  # weights only: activations are quantized per tensor (static) or per token (above)
        if any(isinstance(a, torch.fx.Node) and a.op != "get_attr" for a in node.args):
            continue  # an activation, not a constant weight
        args = [attrgetter(str(a.target))(copied) if isinstance(a, torch.fx.Node) else a for a in node.args]
        inputs.update(a.target for a in node.args if isinstance(a, torch.fx.Node))
        with torch.no_grad():
            value = node.target(*args, **node.kwargs)
        name = f"_dequantized_weight_{folded}"
        copied.register_buffer(name, value)
        with copied.graph.inserting_before(node):
            attr = copied.graph.get_attr(name)
        node.replace_all_uses_with(attr)
        copied.graph.erase_node(node)
        folded += 1
    copied.graph.eliminate_dead_code()
    used = {n.target for n in copied.graph.nodes if n.op == "get_attr"}
    for target in inputs - used:  # the integer weights and their scales: no longer read
        owner, _, leaf = str(target).rpartition(".")
        delattr(attrgetter(owner)(copied) if owner else copied, leaf)
    copied.recompile()
    return copied


def quantize_graph(model: CausalLM, prompt: MethodSpec, name: Pt2eQuantizer,
                   text: CalibrationText | None) -> tuple[torch.fx.GraphModule, Pt2eRecord]:
    """The model captured as the prompt method, quantized by ``name``'s quantizer (calibrated on ``text`` when
    its activations are static); its KV cache left empty. Returns the converted module and its record."""
    from executorch.backends.transforms.duplicate_dynamic_quant_chain import DuplicateDynamicQuantChainPass
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    recipe = PT2E_QUANTIZERS[name]
    started = time.perf_counter()
    cache = model.state_buffers()
    tokens = 0
    with torch.no_grad():
        graph = torch.export.export(model, prompt.example_inputs, dynamic_shapes=prompt.dynamic_shapes,
                                    strict=False).module()
        quantizer = linears_only(recipe.backend_quantizer(), recipe.quantized_outputs)
        prepared = prepare_pt2e(graph, quantizer)  # type: ignore[arg-type]
        if recipe.calibrated:
            assert text is not None, f"quant.pt2e={name} needs a calibration text"
            tokens = calibrate(prepared, text.windows, cache, prompt.max_tokens)
        else:  # weight observers see their weight on any call; activations need no range
            prepared(*prompt.example_inputs)
        converted = convert_pt2e(prepared)
        if recipe.activations == "dynamic":
            DuplicateDynamicQuantChainPass()(converted)  # one quantize chain per linear, as XNNPACK partitions
        elif recipe.activations == "static" and not recipe.quantized_outputs:
            one_quantize_per_reader(converted)
        for buffer in cache:
            converted.get_buffer(buffer).zero_()
    calibration = None if text is None or not recipe.calibrated else CalibrationRecord(
        algorithm=f"pt2e {name}", source=text.source, sha256=text.sha256, tokens=tokens,
        windows=len(text.windows), seconds=round(time.perf_counter() - started, 1))
    record = Pt2eRecord(quantizer=str(name), backend=recipe.backend, weights=f"int{recipe.weight_bits} per channel",
                        activations=recipe.activations, linears=quantized_linears(converted),
                        seconds=round(time.perf_counter() - started, 1), calibration=calibration)
    return converted, record
