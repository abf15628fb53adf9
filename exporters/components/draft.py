"""The draft: a smaller model with the target's tokenizer whose methods propose tokens for the decoder's ``verify``.

``draft.checkpoint`` adds it (``exporters.program.draft``: its methods' names, the pair's check). Its cache is the
target's shape, so it proposes wherever the target can verify; its methods are captured under the module prefix
``draft`` and lowered with the target's into one program. It is checked against its own eager model on the same
windows, with its own tolerance (``draft.quant``'s).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from exporters.components.kind import Basis, Bundled, Finalized, Part
from exporters.components.language_model import LanguageModel, unquantized_nll
from exporters.config import DraftConfig, ExportConfig, ModelConfig
from exporters.console import count
from exporters.context.artifacts import summary
from exporters.errors import UserError
from exporters.manifest import ComponentEntry, HeadVocabularyEntry, Manifest
from exporters.plan.component import Component, ComponentKind, HeadVocabulary, ModelBuild, QuantPlan
from exporters.plan.footprint import Footprint
from exporters.program.constants import DRAFT_VOCAB
from exporters.program.draft import DRAFT, DRAFT_KINDS, check_pair, draft_quant
from exporters.program.methods import MethodTable
from exporters.quant.schemes import check_quant
from exporters.runtime.driver import MethodRoles
from exporters.runtime.quality import perplexity, read_text
from exporters.validation.methods import Judged, Scores, judge, predictions, report
from models.families import family_of_config
from models.gemma4_drafter import is_assistant_folder

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest

log = logging.getLogger("exporters")


class Draft(LanguageModel):
    name = str(ComponentKind.draft)

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """The draft's settings, before any work (the pair itself is checked by :func:`check_pair` at load)."""
        draft = cfg.draft
        if draft.checkpoint is None:
            for key, value in (("quant", draft.quant), ("vocab", draft.vocab), ("vocab_text", draft.vocab_text)):
                if value is not None:
                    raise UserError(f"draft.{key}={value} without draft.checkpoint: there is no draft to apply it to. "
                                    f"Give draft.checkpoint=<folder or .gguf> or leave draft.{key} unset.")
            if draft.tokens != DraftConfig.tokens and "verify" not in cfg.export.methods:
                raise UserError(
                    f"draft.tokens={draft.tokens} without draft.checkpoint or verify in export.methods: it sets how "
                    "many proposed tokens the verify method checks, and this program has none. Give "
                    "draft.checkpoint=<folder or .gguf> (a draft model; it adds verify), or add verify to export.methods "
                    "(export.methods=[prefill,decode,forward,verify]: prompt-lookup speculation), or leave draft.tokens "
                    "unset.")
            return
        if is_assistant_folder(draft.checkpoint):  # Gemma 4's assistant: exporters.components.assistant
            return
        if draft.vocab_text is not None and draft.vocab is None:
            raise UserError(f"draft.vocab_text={draft.vocab_text} without draft.vocab: the text ranks the tokens a "
                            "restricted draft keeps. Give draft.vocab=<how many> (32768 keeps 94% of English and code "
                            "tokens for Qwen2.5) or leave draft.vocab_text unset.")
        if draft.vocab_text is not None:
            read_text(draft.vocab_text, key="draft.vocab_text",
                      fix="Give a UTF-8 text of the kind your app generates with draft.vocab_text=<path>, or leave it "
                          "unset to rank tokens by the tokenizer's order. Nothing was exported.")
        if not Path(draft.checkpoint).expanduser().exists():
            raise UserError(f"draft.checkpoint={draft.checkpoint} does not exist: give a Hugging Face folder or a GGUF "
                            "file of a smaller model with the target's tokenizer. Nothing was exported.")
        if cfg.model.adapters:
            raise UserError("draft.checkpoint with model.adapters: speculative programs do not hold adapters yet (the "
                            "draft would propose for the base model only). Export the adapters without a draft, or the "
                            "draft without adapters.")
        quant = draft_quant(draft, cfg.quant)
        # A target's quant.pt2e the draft would inherit is refused with verify (exporters.program.methods).
        if draft.quant is not None and quant.pt2e is not None:
            raise UserError(f"draft.quant={draft.quant}: a PT2E quantizer converts one graph of the target; the draft is "
                            "quantized with torchao. Use a torchao preset (draft.quant=8da4w, 8da8w, fp32, ...).")
        check_quant(quant, cfg.backend)



    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        draft = cfg.draft
        if draft.checkpoint is None or is_assistant_folder(draft.checkpoint):
            return None
        model = ModelConfig(name=DRAFT, checkpoint=draft.checkpoint)  # its family from its own config.json
        head = HeadVocabulary(draft.vocab, draft.vocab_text) if draft.vocab is not None else None
        return Component(name=DRAFT, kind=ComponentKind.draft,
                         build=ModelBuild(model, basis.state, basis.attention, head),
                         quant=QuantPlan(draft_quant(draft, cfg.quant), cfg.export.tied_embedding, basis.shortcuts),
                         methods=MethodTable.for_component(DRAFT, DRAFT_KINDS, basis.lengths))

    def decoder_methods(self, component: Component) -> Sequence[str]:
        return ("verify",)

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        """Its footprint; the pair (the same tokenizer, a family we build, smaller) checked before any weight is read."""
        footprint = super().open(part, ctx)
        target, ours = ctx.main, ctx.record(part.name)
        check_pair(target.checkpoint, ours.checkpoint, target.parameters, ours.parameters)
        return footprint

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows) -> None:
        record = ctx.record(part.name)
        record.nll, record.scored, _ = unquantized_nll(models[part.name], windows)

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        head_ids = models[part.name].head_ids
        return {} if head_ids is None else {DRAFT_VOCAB: head_ids}

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        """Its methods against its own eager model on the same windows, with its own tolerance."""
        assert ctx.plan.validation is not None
        model, record = models[part.name], ctx.record(part.name)
        specs = ctx.plan.methods.of_component(part.name)
        roles = MethodRoles.choose({n: spec.shape for n, spec in specs.items()})
        found = predictions(model, under, roles, specs, side=part.name)
        scores = Scores.of(found, under.text, model.head_ids)
        tolerance = ctx.plan.validation.component_tolerance[part.name]
        judged = Judged(found, scores, roles, judge(scores, found, tolerance))
        record.validation = report(judged, under, tolerance, perplexity(record.nll, record.scored))
        log.info("  validate: %s %s", part.name, "passed" if record.validation.passed else "FAILED")

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        report = ctx.record(part.name).validation
        return [f"the {part.name}'s methods: {report.describe()}"] if report is not None and not report.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        record, model = ctx.record(part.name), written.components[part.name]
        family = family_of_config(record.checkpoint.hf_config)
        return Finalized(ComponentEntry(
            kind=str(part.component.kind), methods=list(written.methods.of_component(part.name)), adapters=[],
            checkpoint=str(record.checkpoint.path), parameters=model.parameter_count(), state=["kv_cache"],
            quantization=record.quantization, validation=record.validation, family=family.name if family else None,
            vocabulary=self.head_vocabulary(part, ctx)))

    def head_vocabulary(self, part: Part, ctx: ExportContext) -> HeadVocabularyEntry | None:
        """What a restricted head scores (draft.vocab), and how much of the validation text that is (the targets the
        baseline scored it on)."""
        head = part.component.build.head
        if head is None:
            return None
        record = ctx.record(part.name)
        coverage = (round(record.scored / ctx.baseline.text.scored_tokens, 4)
                    if ctx.baseline is not None and record.scored is not None else None)
        return HeadVocabularyEntry(tokens=head.size, ranked_by=head.ranked_by or "tokenizer order", coverage=coverage)

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        record = ctx.record(part.name)
        if stage == "load":
            return f"; {part.name}: {summary(models[part.name])}"
        if stage == "quantize":
            return f"; {part.name}: {record.quantization.describe()}"
        if stage == "validate" and record.validation is not None:
            return f"\n  {part.name}: {record.validation.describe()}"
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        draft = self.entry_of(m)
        return Bundled(readme=bundle_readme(draft)) if draft is not None else Bundled()


def bundle_readme(draft: ComponentEntry) -> str:
    """The bundle README's section on the draft's methods: how an app proposes the tokens ``verify`` checks."""
    quant = draft.quantization.describe() if draft.quantization else "unquantized"
    return (f"## Draft model\n\nThe draft model ({draft.family or 'unknown'} family, "
            f"{count(draft.parameters or 0)} parameters, {quant}) proposes the tokens `verify` checks: "
            "`draft_prefill` takes the text its cache has not seen yet (int64[1, T], its first position int64[1]) and "
            "`draft_decode_one_token` one token at a time, each returning the logits of its last position; its KV "
            "cache is its own, rolled back by position like the target's. "
            + (f"Its logits are {draft.vocabulary.tokens} tokens only (FR-Spec: the most frequent by "
               f"{draft.vocabulary.ranked_by}): `get_draft_vocab` (int64[{draft.vocabulary.tokens}]) gives the token "
               "of each. " if draft.vocabulary else "")
            + "`python -m exporters.generate <folder> prompt=... speculative=draft` does all this.\n\n")
