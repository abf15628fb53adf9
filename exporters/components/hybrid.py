"""Hybrid models (LFM2, Qwen3.5): layers whose state is not a KV cache. What every export option means for them, decided
once, from the model's shapes, before any weight is read.

A short convolution's state is its last inputs, Gated DeltaNet's a matrix per head summing every token seen: both are
overwritten by every call and not indexed by position. So what rolls a KV cache back by position (speculative decoding's ``verify``: rejected tokens are simply overwritten later) would
leave the state holding rejected tokens, and a static-shape backend's padded prompt chunk would push its padding into
the state. Those are refused by name; the rest (any torchao scheme, GPTQ, external weights, int8 KV caches, which
only attention layers have, rings and sinks) applies as to any decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exporters.errors import UserError
from exporters.program.methods import with_verify
from exporters.quant.rotation import rotates
from models.decoder import CausalLM

if TYPE_CHECKING:
    from exporters.plan import ExportPlan
    from exporters.plan.component import Component


def describe_layers(model: CausalLM) -> str:
    """``2 short_conv + 1 attention layers`` (kinds in the order they first appear)."""
    mixers = model.args.layer_mixer
    return " + ".join(f"{mixers.count(m)} {m.value}" for m in dict.fromkeys(mixers)) + " layers"


def check_hybrid(shapes: CausalLM, plan: "ExportPlan", component: "Component") -> None:
    """Refuse, naming the option and what to do instead, what has not been built or validated for ``component``'s
    hybrid layers (a model with attention layers only passes)."""
    if not shapes.args.hybrid:
        return
    what = f"{'this model' if component.is_decoder else 'the draft'} ({describe_layers(shapes)})"
    state = ("a layer with a recurrent state (a short convolution's last inputs, Gated DeltaNet's matrices) has it "
             "overwritten by every call, whatever the position")
    blockers = []
    if "verify" in with_verify(plan.config.export.methods, plan.config.draft):
        blockers.append(("speculative decoding (verify, draft.checkpoint)",
                         f"{state}, so the tokens verify rejects cannot be rolled back by position as a KV cache's are",
                         "export without verify and draft.*"))
    if not plan.backend.dynamic_shapes:
        blockers.append((f"backend={plan.backend.name} (static shapes)",
                         f"{state}, and a static-shape backend pads the prompt to a fixed chunk, padding it would keep",
                         "use backend=xnnpack or backend=portable"))
    if component.adapters or component.methods.slots is not None:
        blockers.append(("model.adapters / export.adapters=swappable", "LoRA adapters on hybrid models are not built "
                         "or validated yet", "export the base without adapters"))
    if rotates(component.quant.config):
        blockers.append(("quant.rotation / quant.online_hadamard", "rotations are folded into attention and MLP "
                         "layers; the recurrent layers' gated projections are not rotated yet",
                         "use quant=8da4w_calibrated (GPTQ) or quant=8da4w"))
    if component.quant.config.pt2e is not None:
        blockers.append((f"quant.pt2e={component.quant.config.pt2e}", "PT2E quantizers are not validated on "
                         "recurrent layers yet", "use a torchao scheme (quant=8da4w, 8da8w, 8da4w_calibrated)"))
    if blockers:
        lines = "; ".join(f"{option}: {why}. Instead, {fix}" for option, why, fix in blockers)
        raise UserError(f"{what} cannot be exported with {lines}.")
