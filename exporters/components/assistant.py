"""Gemma 4's assistant: proposes the decoder's next tokens from the decoder's own state (``models.gemma4_drafter``).

``draft.checkpoint=<the assistant's folder>`` adds it (google/gemma-4-e2b-it-assistant beside gemma-4-e2b-it). It keeps
no cache: its one method, ``draft_propose`` (the last token int64[1, 1] and its position int64[1] -> ``draft.tokens``
greedy proposals int64[1, K]), is captured from the decoder's module with the assistant attached, so it reads the
decoder's caches and final hidden states under the names the decoder's methods write them. The decoder keeps those
hidden states (``decoder_state``) and gets ``verify``. Validated against the eager assistant over the eager decoder's
state, and by the decoder's speculative check (speculation with it gives plain greedy decoding's tokens).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from exporters.components.kind import Basis, Bundled, Finalized, Kind, Part
from exporters.config import ExportConfig, ModelConfig
from exporters.context.artifacts import summary
from exporters.errors import UserError
from exporters.manifest import AssistantCheck, ComponentEntry, Manifest
from exporters.plan.component import Component, ComponentKind, FolderBuild, QuantPlan
from exporters.plan.footprint import Footprint, encoder_footprint
from exporters.program.draft import ASSISTANT_METHOD, DRAFT, draft_quant
from exporters.program.methods import MethodTable
from exporters.program.signatures import signature
from exporters.quant.apply import quantize_model
from exporters.quant.schemes import check_quant
from exporters.runtime.driver import Driver, MethodRoles
from models.checkpoint import stored_elements, weight_files_of
from models.errors import ModelError
from models.gemma4_drafter import is_assistant_folder, load_drafter, proposing

if TYPE_CHECKING:
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.manifest import AppliedQuantization, Signature
    from exporters.program.lengths import Lengths
    from exporters.validation.under_test import ProgramUnderTest

log = logging.getLogger("exporters")

DECODER = "decoder"
# Where in the first validation window the method is checked: prompts of these shares of its length, and the whole.
CHECKED_AT = (0.25, 0.5, 0.75, 1.0)


def _asks_for_it(cfg: ExportConfig) -> bool:
    return cfg.draft.checkpoint is not None and is_assistant_folder(cfg.draft.checkpoint)


@dataclass(frozen=True)
class AssistantBuild(FolderBuild):
    """The assistant's folder and how many tokens its method proposes; it is built beside the loaded decoder, whose
    caches it reads (:meth:`Assistant.load`), never alone."""

    tokens: int = 4

    def build(self, checkpoint: Any, device: str = "cpu") -> Any:
        raise TypeError("Gemma 4's assistant is built bound to its decoder: exporters.components.assistant.load")


@dataclass
class AssistantRecord:
    """What the stages learn of the assistant."""

    folder: Path
    parameters: int | None = None
    quantization: AppliedQuantization | None = None
    check: AssistantCheck | None = None


class Assistant(Kind):
    name = str(ComponentKind.assistant)

    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """What the assistant cannot do, before any work (the pair itself is checked when it is bound, at load)."""
        if not _asks_for_it(cfg):
            return
        draft = cfg.draft
        for key, value in (("vocab", draft.vocab), ("vocab_text", draft.vocab_text)):
            if value is not None:
                raise UserError(f"draft.{key}={value} with Gemma 4's assistant ({draft.checkpoint}): its proposals are "
                                "chosen by its own head (its centroids, when it has them), which a restricted "
                                f"vocabulary does not apply to. Leave draft.{key} unset.")
        if cfg.export.attention_sink:
            raise UserError(f"export.attention_sink={cfg.export.attention_sink} with Gemma 4's assistant: it reads the "
                            "decoder's final hidden state by position, which an endless ring of positions has no place "
                            "for. Leave export.attention_sink at 0, or export without draft.checkpoint.")
        if draft.tokens > lengths.call_tokens - 2:
            # Its sliding layers read one position more than the target's window, which a ring cache keeps only while
            # the last call wrote at most call_tokens - 1 tokens past it (a verify that kept none of K proposals).
            most = lengths.call_tokens - 2
            raise UserError(f"draft.tokens={draft.tokens} with Gemma 4's assistant: a call of the decoder takes at most "
                            f"{lengths.call_tokens} tokens here, and with the assistant draft.tokens may be at most "
                            f"{most} (its sliding layers read one position beyond the window, which a verify of "
                            f"{lengths.call_tokens} tokens can overwrite in a ring cache). "
                            + (f"Lower draft.tokens to {most} or raise export.max_seq_len." if most >= 1
                               else "Raise export.max_seq_len."))
        if cfg.model.adapters:
            raise UserError("draft.checkpoint (Gemma 4's assistant) with model.adapters: its proposals read the base "
                            "model's state only. Export the adapters without it, or it without adapters.")
        quant = draft_quant(draft, cfg.quant)
        if quant.pt2e is not None:
            raise UserError(f"Gemma 4's assistant with quant.pt2e={quant.pt2e}: it is quantized with torchao. Give "
                            "draft.quant=<a torchao preset> (8da4w, 8da8w, fp32, ...).")
        check_quant(quant, cfg.backend)
        if QuantPlan(quant, cfg.export.tied_embedding).calibrated:
            raise UserError(f"Gemma 4's assistant quantized with a calibrated scheme ({'draft.quant' if draft.quant else 'quant'}"
                            f"={draft.quant or 'the target quant'}: quant.algorithm, size budget or rotation): "
                            "calibration runs a model on text, and the assistant runs only beside its target. Give "
                            "draft.quant=<a data-free preset> (8da4w, 8da8w, fp32).")

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        if not _asks_for_it(cfg):
            return None
        return Component(name=DRAFT, kind=ComponentKind.assistant,
                         build=AssistantBuild(ModelConfig(name=DRAFT, checkpoint=cfg.draft.checkpoint),
                                              cfg.draft.tokens),
                         quant=QuantPlan(draft_quant(cfg.draft, cfg.quant), cfg.export.tied_embedding, basis.shortcuts),
                         methods=MethodTable({}, {}, {}))

    def decoder_methods(self, component: Component) -> Sequence[str]:
        return ("verify",)

    def decoder_state(self, component: Component) -> Sequence[str]:
        return ("final_hidden",)

    def open(self, part: Part, ctx: ExportContext) -> Footprint:
        """The decoder is a Gemma 4 (the assistant reads its caches); the pair's shapes are checked at load. Its
        footprint: its weights (counted from the files' headers), held beside the decoder's from load to the end."""
        folder = Path(str(part.component.build.model.checkpoint)).expanduser()
        target = ctx.record(DECODER).checkpoint.hf_config
        if "gemma4" not in str(getattr(target, "model_type", "")):
            raise UserError(f"draft.checkpoint={folder} is Gemma 4's assistant, and the model is "
                            f"{getattr(target, 'model_type', 'unknown')}: it reads a Gemma 4's caches. Give a Gemma 4 "
                            "(model.checkpoint=<gemma-4-e2b-it>) or a draft model of the target's family.")
        ctx.records[part.name] = AssistantRecord(folder)
        try:
            parameters = stored_elements(weight_files_of(folder))
        except ModelError as e:
            raise UserError(f"draft.checkpoint={folder}: {e}") from e
        return encoder_footprint(parameters)

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        record = ctx.record(part.name)
        try:
            models[part.name] = load_drafter(record.folder, models[DECODER])
        except ModelError as e:
            raise UserError(f"draft.checkpoint={record.folder}: {e}") from e
        record.parameters = models[part.name].parameter_count()

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        quant = part.component.quant
        ctx.record(part.name).quantization = quantize_model(models[part.name], quant.config, quant.tied_storage,
                                                            None, quant.shortcuts)

    def capture(self, part: Part, models: dict[str, Any]) -> dict[str, tuple[Any, Signature]]:
        """``draft_propose`` from the decoder's module with the assistant attached: the caches and final hidden states
        it reads are the decoder's buffers, named as its methods name them."""
        target, drafter = models[DECODER], models[part.name]
        assert isinstance(part.component.build, AssistantBuild)
        inputs = (torch.zeros(1, 1, dtype=torch.int64), torch.tensor([0], dtype=torch.int64))
        with torch.no_grad(), proposing(target, drafter, part.component.build.tokens):
            program = torch.export.export(target, inputs, strict=False)
        return {ASSISTANT_METHOD: (program, signature(program))}

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        """The method's proposals after prompts of the first validation window against the eager assistant's over the
        eager decoder's state (the decoder's speculative check then runs speculation with it)."""
        if ASSISTANT_METHOD not in under.program.method_names:  # an undelegated validation: the hook's method is not
            return
        target, drafter, record = models[DECODER], models[part.name], ctx.record(part.name)
        assert isinstance(part.component.build, AssistantBuild)
        k = part.component.build.tokens
        roles = MethodRoles.choose({n: spec.shape for n, spec in ctx.plan.methods.of_adapter(None).items()})
        driver, window = Driver(under.program, roles), under.text.windows[0]
        last = min(window.shape[1], under.context) - 1
        positions = sorted({max(1, min(last, round(last * share))) for share in CHECKED_AT})
        first = every = seen = 0  # the prompt grows from one check to the next: each feeds only what is new
        target.reset_cache()
        for p in positions:
            token, at = window[:, p:p + 1], torch.tensor([p])
            driver.prefill(window[:, seen:p], seen)
            got = under.program.run(ASSISTANT_METHOD, token, at)[0].reshape(-1).tolist()
            with torch.no_grad():
                target(window[:, seen:p], torch.tensor([seen]))
                want = drafter.propose(target, token, at, k).reshape(-1).tolist()
            first, every, seen = first + (got[0] == want[0]), every + (got == want), p
        target.reset_cache()
        n = len(positions)
        record.check = AssistantCheck(tokens=k, positions=positions, first_agreement=round(first / n, 4),
                                      all_agreement=round(every / n, 4), min_first=under.tolerance.min_top1,
                                      passed=first / n >= under.tolerance.min_top1)
        log.info("  validate: assistant %s", record.check.describe())

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        check = ctx.record(part.name).check
        return [f"the assistant's draft_propose: {check.describe()}"] if check is not None and not check.passed else []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        record = ctx.record(part.name)
        return Finalized(ComponentEntry(
            kind=str(part.component.kind), methods=[ASSISTANT_METHOD], adapters=[], checkpoint=str(record.folder),
            parameters=record.parameters, state=[], quantization=record.quantization, family="gemma4",
            assistant=record.check))

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        record = ctx.record(part.name)
        if stage == "load":
            return f"; Gemma 4's assistant: {summary(models[part.name])}, reading the decoder's caches"
        if stage == "quantize" and record.quantization is not None:
            return f"; assistant: {record.quantization.describe()}"
        if stage == "validate" and record.check is not None:
            return f"\n  assistant: {record.check.describe()}"
        return ""

    def bundle(self, m: Manifest) -> Bundled:
        entry = self.entry_of(m)
        return Bundled(readme=bundle_readme(entry)) if entry is not None else Bundled()


def bundle_readme(entry: ComponentEntry) -> str:
    """The bundle README's section on the assistant: how an app gets proposals for ``verify``."""
    quant = entry.quantization.describe() if entry.quantization else "unquantized"
    k = entry.assistant.tokens if entry.assistant is not None else "K"
    return ("## Gemma 4's assistant\n\nThe program holds Gemma 4's assistant (" + quant + "), which proposes the tokens "
            "`verify` checks from the model's own state: `draft_propose` takes the last token (int64[1, 1]) and its "
            f"position (int64[1]) and returns {k} proposals (int64[1, {k}]) to follow it. It keeps no cache of its own: it "
            "reads the model's caches and the final hidden states every call of the model keeps, so call it after the "
            "model has seen every token before the last one (the prompt, or the tokens a verify kept). "
            "`python -m exporters.generate <folder> prompt=... speculative=draft` does all this.\n\n")
