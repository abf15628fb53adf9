"""Capture: one ``torch.export`` per method over the same module (same weights, same KV-cache buffers).

Each method is captured separately: ``to_edge_transform_and_lower`` rewrites the programs it is given,
so one ExportedProgram must not appear under two names (docs/DESIGN.md). Each adapter's methods
(``exporters.program.adapters``) are captured from the same module with that adapter active, so they read
the very same base weight tensors and the backend stores those once.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from exporters.components import parts
from exporters.context import ExportContext
from exporters.context.artifacts import CapturedMethods, EagerModel, ProgramMethods
from exporters.program.methods import MethodSpec
from exporters.program.signatures import signature
from exporters.quant.activations import share_activation_quantization
from exporters.stages.pipeline import Stage
from models.lora import active_adapter


class Prefixed(torch.nn.Module):
    """A component's model under its name: its buffers are named ``<component>.layers.0...``, apart from the
    decoder's (ExecuTorch shares a mutable buffer between the methods that name it alike)."""

    def __init__(self, name: str, model: torch.nn.Module) -> None:
        super().__init__()
        self.component = name
        self.add_module(name, model)

    def forward(self, inputs: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """A language model's (tokens, position), or an encoder's input alone."""
        model = getattr(self, self.component)
        return model(inputs) if input_pos is None else model(inputs, input_pos)


class CaptureStage(Stage):
    name = "capture"
    after = ("quantize",)

    def run(self, quantized: EagerModel, ctx: ExportContext) -> CapturedMethods:
        """Each method captured from the eager model, or from the PT2E-converted graph when there is one."""
        table = self.plan.methods
        specs, aliases, adapter_of = table.specs, table.aliases, table.adapter_of
        others = {name: Prefixed(name, m) for name, m in quantized.components.items()}
        model = quantized.model
        # quant.pt2e: every method comes from the one converted graph (same integer weights, same scales).
        source = model if quantized.graph is None else quantized.graph
        # The undelegated programs (validation) from its copy computing what the backend computes, faster.
        reference = source if quantized.reference_graph is None else quantized.reference_graph

        def capture(name: str, spec: MethodSpec, module: torch.nn.Module = source) -> torch.export.ExportedProgram:
            ours = name not in table.component_of
            if not ours:  # another component's method: from its own model
                module = others[table.component_of[name]]
            every = model.logits_of_every_position() if spec.full_logits else contextlib.nullcontext()
            embeds = (model.returns_token_embeddings() if ours and spec.gives == "embeddings"
                      else contextlib.nullcontext())
            inputs = spec.inputs_for(model.args.embedding_width, model.activation_dtype())
            with torch.no_grad(), active_adapter(model, adapter_of[name]), every, embeds:
                return torch.export.export(module, inputs, dynamic_shapes=spec.dynamic_shapes, strict=False)

        def capture_all(module: torch.nn.Module = source) -> dict[str, torch.export.ExportedProgram]:
            return {name: capture(name, spec, module) for name, spec in specs.items() if name not in aliases}

        programs = capture_all()
        for name, program in programs.items():
            # The decoder's methods, where a duplicate convert runs at every token. An encoder runs once an input, and
            # in Gemma 4's audio tower (undelegated ops between its linears) one merged activation read by two
            # XNNPACK partitions made them a dependency cycle, which to_backend refuses.
            if specs[name].takes in ("tokens", "embeddings"):
                share_activation_quantization(program)
        signatures = {name: signature(p, embeddings_in=specs[name].takes == "embeddings") for name, p in programs.items()}
        models = self.models_of(quantized)
        for part in parts(self.plan):  # methods of a part's own beyond the table (set_adapter)
            for name, (program, found) in part.kind.capture(part, models).items():
                programs[name], signatures[name] = program, found
        # Backends this host's runtime cannot execute are validated on a second, untouched capture (lowering
        # rewrites the programs it is given).
        undelegated = capture_all(reference) if self.plan.keep_undelegated else None
        for alias, source in aliases.items():
            signatures[alias] = signatures[source]
            if undelegated is not None:
                undelegated[alias] = undelegated[source]
        table_fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(table)}
        return CapturedMethods(model=model, methods=ProgramMethods(**table_fields, signatures=signatures),
                               programs=programs, undelegated=undelegated, components=quantized.components)
