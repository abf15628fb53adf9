"""The decoder: the program's main model, token ids in, logits out, a KV cache.

Every program holds one. Its methods are ``export.methods`` as the layout names them, plus what the other
components need of it (``verify`` for a draft, ``token_embedding`` and ``text_decoder`` for a vision encoder:
:meth:`Kind.decoder_methods`); its quantization and validation are the manifest's top-level ones. Its variants
(adapters, slots) are kinds of their own (``exporters.components.adapters``, ``.slots``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from exporters.components.kind import Basis, Finalized, Part
from exporters.components.language_model import LanguageModel, unquantized_nll
from exporters.context.artifacts import summary
from exporters.manifest import ComponentEntry, MethodEntry, ModelEntry, Signature
from exporters.plan.component import Component, ComponentKind, ModelBuild, QuantPlan
from exporters.program.cache import kv_cache_entry
from exporters.program.constants import constant_methods, recorded
from exporters.program.draft import ASSISTANT_METHOD
from exporters.program.layouts import LAYOUTS, layout_manifest
from exporters.program.methods import MethodTable
from exporters.program.swappable import base_quant, slot_plan
from exporters.runtime.driver import Driver, MethodRoles
from exporters.runtime.speculative import AssistantProposer, DraftProposer, Proposer
from exporters.validation.methods import validate_methods
from models.families import family_of_config
from models.lora import active_adapter
from models.vision import text_only

if TYPE_CHECKING:
    from exporters.config import ExportConfig
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest

DECODER = "decoder"  # the component's name; its methods and buffers are unprefixed


def proposer_of(ctx: ExportContext, models: dict[str, Any]) -> Callable[[Any], Proposer] | None:
    """How the program's proposer is made from the program, when it holds one (a draft model's methods, or Gemma 4's
    assistant's): what verify is checked with (speculative greedy decoding against plain)."""
    found = next((c for c in ctx.plan.components if c.kind in (ComponentKind.draft, ComponentKind.assistant)), None)
    if found is None:
        return None
    if found.kind == ComponentKind.assistant:
        return lambda program: AssistantProposer(program, ASSISTANT_METHOD)
    specs = ctx.plan.methods.of_component(found.name)
    roles, head_ids = MethodRoles.choose({n: spec.shape for n, spec in specs.items()}), models[found.name].head_ids
    return lambda program: DraftProposer(Driver(program, roles), head_ids)


class Decoder(LanguageModel):
    name = str(ComponentKind.decoder)
    main = True

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component:
        ex = cfg.export
        # export.methods, then what the other components need of the decoder (verify, text_decoder, ...)
        kinds = [*ex.methods, *(k for k in basis.decoder_methods if k not in ex.methods)]
        return Component(
            name=DECODER, kind=ComponentKind.decoder,
            build=ModelBuild(cfg.model, basis.state, basis.attention,
                             keeps_final_hidden="final_hidden" in basis.decoder_state),
            quant=QuantPlan(base_quant(cfg), ex.tied_embedding, basis.shortcuts),
            # Aliases (forward = prefill) are emitted as renamed plans, a shortcut through the emitter's internals.
            methods=MethodTable.of(kinds, LAYOUTS[ex.layout], basis.lengths, list(cfg.model.adapters),
                                   share_graphs=basis.shortcuts, slots=slot_plan(cfg),
                                   applied=dict(basis.decoder_adapters)))

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows) -> None:
        record, model = ctx.record(part.name), models[part.name]
        with active_adapter(model, None):  # the base, whatever adapters are attached
            record.nll, record.scored, record.unquantized = unquantized_nll(model, windows)

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        plan = ctx.plan
        return constant_methods(models[part.name].args, ctx.record(part.name).checkpoint, plan.methods.specs,
                                plan.lengths.max_seq_len, plan.backend.dynamic_shapes)

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        record = ctx.record(part.name)
        record.validation = validate_methods(models[part.name], under, ctx.plan.methods.of_adapter(None),
                                             proposer=proposer_of(ctx, models), unquantized_logits=record.unquantized)
        record.unquantized = None  # compared: not kept through finalize

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        report = ctx.record(part.name).validation
        return [report.describe()] if report is not None and not report.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        methods = [n for n in written.methods.specs if n not in written.methods.component_of]
        return Finalized(ComponentEntry(
            kind=str(part.component.kind), methods=methods, adapters=part.component.adapters,
            checkpoint=str(ctx.record(part.name).checkpoint.path), parameters=written.model.parameter_count(),
            state=["kv_cache"]), fields=program_fields(ctx, written))

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        record = ctx.record(part.name)
        if stage == "load":
            hf_config = record.checkpoint.hf_config
            family = family_of_config(hf_config)
            alone = text_only(hf_config, record.checkpoint.path, ctx.config.model.image_size)
            return (f"{family.name if family else 'unknown'} family, {summary(models[part.name])}"
                    + (f"; {alone}" if alone else ""))
        if stage == "quantize":
            return record.quantization.describe()
        if stage == "validate":
            return record.validation.describe()
        return ""


def _token_inputs(found: Signature) -> int:
    """The tokens a fixed-shape method takes: its first input's length when that is token ids [1, T], else 0."""
    first = found.inputs[0] if found.inputs else None
    return int(first.shape[1]) if first is not None and first.dtype == "int64" and len(first.shape) == 2 else 0


def program_fields(ctx: ExportContext, written: WrittenProgram) -> dict[str, Any]:
    """The manifest's sections on the program as an LLM runner drives it: every method (the other components'
    included), the layout, the constants, the model and its KV cache."""
    ckpt, model = ctx.record(DECODER).checkpoint, written.model
    specs, base = written.methods.specs, written.methods.of_adapter(None)
    # The config check refused method sets where nothing takes one token, so there always are roles.
    roles = MethodRoles.choose({n: spec.shape for n, spec in base.items()})
    family = family_of_config(ckpt.hf_config)
    return dict(
        methods={
            name: MethodEntry(inputs=written.methods.signatures[name].inputs,
                              outputs=written.methods.signatures[name].outputs,
                              dynamic_tokens=spec.dynamic,
                              tokens=[spec.min_tokens, spec.max_tokens],
                              delegated_partitions=written.delegated_partitions.get(name, 0),
                              lowered_once_with=written.methods.aliases.get(name))
            for name, spec in specs.items()
        } | {  # methods of a component's own beyond the table (draft_propose, set_adapter): fixed shapes
            name: MethodEntry(inputs=found.inputs, outputs=found.outputs, dynamic_tokens=False,
                              tokens=[_token_inputs(found)] * 2,
                              delegated_partitions=written.delegated_partitions.get(name, 0))
            for name, found in written.methods.signatures.items() if name not in specs
        },
        layout=layout_manifest(ctx.plan.layout, {name: spec.kind for name, spec in base.items()},
                               roles.prompt, roles.step,
                               all(spec.dynamic for spec in base.values() if spec.kind in ("prefill", "forward")),
                               slides=written.constant_methods["get_max_seq_len"] <
                               written.constant_methods["get_max_context_len"],
                               sink=model.args.attention_sink > 0),
        constant_methods=recorded(written.constant_methods),
        model=ModelEntry(checkpoint=str(ckpt.path), architecture=list(ckpt.hf_config.architectures or []),
                         family=family.name if family else None,
                         attention=str(model.args.attention),
                         parameters=model.parameter_count(),
                         converted_from=ckpt.converted_from),
        kv_cache=kv_cache_entry(model, max(spec.max_tokens for spec in base.values())),
    )
