"""The kinds of model a program holds, each one module implementing the protocol of :mod:`.kind`, registered once.

:data:`KINDS` is the registry, in the order every stage visits the parts: the decoder first (the others read its
checkpoint and model), its variants, then the other components. A new kind is a module here and a line below (and,
for a component, a value of ``exporters.plan.ComponentKind``): docs/ARCHITECTURE.md, "Components".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporters.components.adapters import Adapters
from exporters.components.assistant import Assistant
from exporters.components.audio import Audio
from exporters.components.decoder import Decoder
from exporters.components.draft import Draft
from exporters.components.kind import Basis, Bundled, Finalized, Kind, Part
from exporters.components.slots import Slots
from exporters.components.speech import Speech
from exporters.components.vision import Vision

if TYPE_CHECKING:
    from exporters.plan import ExportPlan

__all__ = ["Basis", "Bundled", "Finalized", "KINDS", "Kind", "Part", "parts"]

#: Every kind by name, in the order the stages visit them.
KINDS: dict[str, Kind] = {kind.name: kind for kind in (Decoder(), Adapters(), Slots(), Draft(), Assistant(), Vision(), Audio(),
                                                   Speech())}


def parts(plan: ExportPlan) -> list[Part]:
    """The parts of ``plan``'s export in registry order: each component with its kind, each variant that applies with
    the decoder."""
    found = []
    for kind in KINDS.values():
        if kind.variant:
            found += [Part(kind, plan.main)] if kind.applies(plan) else []
        else:
            found += [Part(kind, c) for c in plan.components if c.kind == kind.name]
    return found
