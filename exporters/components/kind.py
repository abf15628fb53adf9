"""The component protocol: each kind of model a program holds is one module implementing :class:`Kind`.

A program is a set of components (``exporters.plan.Component``: the decoder, a draft, a vision encoder), and the
decoder may have variants (LoRA adapters as methods of their own, or swappable slots). Each is a **part** of the
export (:class:`Part`: a kind and the component it works on). The stages loop over the plan's parts and call these
hooks; a stage names no kind. Every hook has a default that does nothing, so a kind implements the phases it takes
part in. What a part learns goes into its own record, ``ctx.records[part.name]``, a dataclass of its kind's module.

Which stage calls which hook:

==================  ===================================================================================
hook                caller
==================  ===================================================================================
``check``           ``exporters.components.resolve.check_config``: its part of the config, before any work
``plan``            ``resolve``: its component of the plan (None: not in this export); variants: ``applies``
``decoder_methods`` ``resolve``: the method kinds it adds to the decoder (a draft: ``verify``)
``decoder_state``   ``resolve``: the state it needs the decoder to keep (Gemma 4's assistant: ``final_hidden``)
``open``            load, before any weight is read: its checkpoint opened, its shapes checked, its footprint
``load``            load: its model built with the weights (or, a variant, attached to the decoder)
``baseline``        baseline: the unquantized model scored on what validation will compare
``quantize``        quantize
``capture``         capture: methods of its own beyond the plan's method table (``set_adapter``)
``passes``          lower: the passes it needs after ``to_edge``, before partitioning
``constants``       lower: the constant methods it adds
``validate``        validate: its methods in the program against its eager model
``failures``        finalize: what failed its validation (the program is then rejected)
``finalize``        finalize: its manifest entries and the files it writes beside the program
``describe``        the console line of load, quantize and validate: its part of it
``bundle``          ``exporters.release.bundle``: its README section, files and manifest fields, from the manifest
==================  ===================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

if TYPE_CHECKING:
    from exporters.config import Attention, ExportConfig
    from exporters.context import ExportContext
    from exporters.context.artifacts import WrittenProgram
    from exporters.manifest import ComponentEntry, Manifest, Signature
    from exporters.plan import Component, ExportPlan, StatePlan
    from exporters.plan.footprint import Footprint
    from exporters.program.lengths import Lengths
    from exporters.runtime.quality import TextWindows
    from exporters.validation.under_test import ProgramUnderTest


@dataclass(frozen=True)
class Basis:
    """What every component of a plan is resolved against (``exporters.components.resolve``)."""

    lengths: Lengths
    state: StatePlan  # the decoder's KV cache, whose shape a draft's copies
    attention: Attention  # the backend's preference
    shortcuts: bool
    # The method kinds the other components need of the decoder (their decoder_methods), in the order planned.
    decoder_methods: tuple[str, ...] = ()
    # The state the other components need the decoder to keep beyond its caches (their decoder_state).
    decoder_state: tuple[str, ...] = ()
    # The decoder's method kinds the other components need computed with an adapter (their decoder_adapters).
    decoder_adapters: tuple[tuple[str, str], ...] = ()


@dataclass
class Finalized:
    """What a part gives finalize: its entry in the manifest's ``components``, the top-level manifest fields it
    fills (``adapters``, ``swappable``), and files it wrote under private names (final path -> that name), renamed
    into place with the program."""

    entry: ComponentEntry | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    staged: dict[Path, Path] = field(default_factory=dict)


@dataclass
class Bundled:
    """What a part adds to a release bundle, read from the export's manifest alone: its section of the bundle's
    README, the files of the run folder it carries (beside the program, data and tokenizer files), and its fields of
    the bundle's manifest."""

    readme: str = ""
    files: list[str] = field(default_factory=list)
    fields: dict[str, Any] = field(default_factory=dict)
    # A main model other than the decoder: the README's "Run it" and "Validation" sections in place of an LLM's.
    run: str = ""
    validation: str = ""


@dataclass(frozen=True)
class Part:
    """One kind at work on one component of the plan (a variant's component is the decoder it varies)."""

    kind: Kind
    component: Component

    @property
    def name(self) -> str:
        """Its record's key: the component's name, or a variant's kind."""
        return self.kind.name if self.kind.variant else self.component.name


class Kind:
    """One kind of model a program holds; stateless (what it learns goes into ``ctx.records[part.name]``)."""

    name: ClassVar[str]
    # A variant of the decoder (adapters, slots) plans no component of its own; it applies to the decoder's.
    variant: ClassVar[bool] = False
    # A program's main model (the decoder, a speech model): the first component, whose methods are unprefixed and whose
    # record is the manifest's top level. A main kind other than the decoder plans a component only for the checkpoints
    # it claims (exporters.components.resolve).
    main: ClassVar[bool] = False

    # -- the plan ------------------------------------------------------------------------------------------------
    def check(self, cfg: ExportConfig, lengths: Lengths) -> None:
        """Refuse what this kind cannot do with ``cfg``, naming the field and the fix."""

    def plan(self, cfg: ExportConfig, basis: Basis) -> Component | None:
        """Its component of the plan (None: ``cfg`` has none)."""
        return None

    def applies(self, plan: ExportPlan) -> bool:
        """A variant: whether it is part of ``plan``'s export."""
        return False

    def decoder_methods(self, component: Component) -> Sequence[str]:
        """The method kinds the decoder gets because the program holds ``component``."""
        return ()

    def decoder_adapters(self, component: Component) -> dict[str, str]:
        """The decoder's method kinds that compute with an adapter because the program holds ``component`` (kind ->
        the adapter's name: Granite Speech's text_decoder applies its checkpoint's adapter for prompts with audio)."""
        return {}

    def decoder_state(self, component: Component) -> Sequence[str]:
        """The state the decoder keeps because the program holds ``component`` (``final_hidden``: each position's
        final hidden state, which Gemma 4's assistant reads)."""
        return ()

    # -- the stages ----------------------------------------------------------------------------------------------
    def open(self, part: Part, ctx: ExportContext) -> Footprint | None:
        """Before any weight is read: open its checkpoint, check its shapes, make its record; its footprint."""
        return None

    def load(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """Its model with the checkpoint's weights, into ``models[part.name]``."""

    def baseline(self, part: Part, ctx: ExportContext, models: dict[str, Any], windows: TextWindows | None) -> None:
        """The unquantized model on what validation compares: the validation text's ``windows`` (None when the main
        model is not a language model: a speech model's recording is its own), ..."""

    def quantize(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> None:
        """Quantize its model in place."""

    def capture(self, part: Part, models: dict[str, Any]) -> dict[str, tuple[Any, Signature]]:
        """Methods of its own beyond the plan's method table: name -> (ExportedProgram, signature)."""
        return {}

    def passes(self, part: Part) -> list[Any]:
        """Passes after ``to_edge``, before partitioning."""
        return []

    def constants(self, part: Part, ctx: ExportContext, models: dict[str, Any]) -> dict[str, Any]:
        """Constant methods it adds to the program."""
        return {}

    def validate(self, part: Part, ctx: ExportContext, under: ProgramUnderTest, models: dict[str, Any]) -> None:
        """Its methods in the program against its eager model, into its record."""

    def failures(self, part: Part, ctx: ExportContext) -> list[str]:
        """What failed its validation, one phrase each (empty: passed, or not validated)."""
        return []

    def finalize(self, part: Part, ctx: ExportContext, written: WrittenProgram, pte: Path) -> Finalized:
        """Its manifest entries and files; ``pte``: where the program is being put (accepted or rejected)."""
        return Finalized()

    def describe(self, stage: str, part: Part, ctx: ExportContext, models: dict[str, Any]) -> str:
        """Its part of ``stage``'s console line."""
        return ""

    # -- after the export ----------------------------------------------------------------------------------------
    def bundle(self, m: Manifest) -> Bundled:
        """What a release bundle of the export ``m`` describes carries for this kind (nothing if ``m`` has none)."""
        return Bundled()

    def entry_of(self, m: Manifest) -> ComponentEntry | None:
        """This kind's entry among the manifest ``m``'s components (None: the export has none of it)."""
        return next((e for e in m.components.values() if e.kind == self.name), None)
