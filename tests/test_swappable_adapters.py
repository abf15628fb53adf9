"""Swappable adapters (``export.adapters=swappable``): one set of the base's methods whose LoRA matrices are state
an app writes with ``set_adapter``; any PEFT adapter whose targets and ranks fit is data (``models.lora_slots``).

The adapters are PEFT's, trained on the truncated real SmolLM2 (``tests/peft_adapters.py``): every recipe (attention,
every linear with rsLoRA, MLP only, per-layer ranks and alphas) laid out in the slots must compute what PEFT computes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.checkpoint import build_model, open_checkpoint
from models.lora import active_adapter, attach_adapters, read_adapter
from models.lora_slots import SlotError, attach_slots, pack, slot_geometry
from tests.peft_adapters import RECIPES

KINDS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_every_peft_recipe_in_the_slots_computes_what_peft_computes(smollm2_truncated: Path, lora_adapters) -> None:  # type: ignore[no-untyped-def]
    """Eager: the base with PEFT's adapter active (slots zero) against the base with that adapter packed into the
    slots (PEFT inactive); and all-zero slots are the base, bit for bit."""
    model = build_model(open_checkpoint(smollm2_truncated), 64)
    adapters = [read_adapter(name, folder, model) for name, folder in lora_adapters.items()]
    attach_adapters(model, adapters)
    tokens = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))

    def logits(adapter: str | None = None) -> torch.Tensor:
        with torch.no_grad(), active_adapter(model, adapter):
            out = model(tokens, torch.tensor([0]), full_logits=True)
        model.reset_cache()
        return out

    base = logits()
    geometry = slot_geometry(model, KINDS, rank=max(max(a.ranks) for a in adapters))
    slots = attach_slots(model, geometry)
    assert torch.equal(logits(), base), "zero slots add exactly nothing"
    for adapter in adapters:
        peft = logits(adapter.name)
        slots.load(pack(adapter.name, adapter.config, adapter.matrices, geometry))
        torch.testing.assert_close(logits(), peft, atol=1e-4, rtol=1e-4, msg=adapter.name)
        assert (peft - base).abs().max() > 1e-2, f"{adapter.name} changes the logits"
        slots.load(geometry.zeros())
    assert torch.equal(logits(), base)


def test_an_adapter_that_does_not_fit_the_slots_is_named(smollm2_truncated: Path, lora_adapters) -> None:  # type: ignore[no-untyped-def]
    model = build_model(open_checkpoint(smollm2_truncated), 64, device="meta")
    recipe = read_adapter("recipe", lora_adapters["recipe"], model)  # MLP, rank 16
    small = slot_geometry(model, ["gate_proj", "up_proj", "down_proj"], rank=8)
    with pytest.raises(SlotError, match=r"adapter recipe has rank 16 on .*export.lora_max_rank=8. Export the program "
                                        r"again with export.lora_max_rank=16 or more"):
        pack("recipe", recipe.config, recipe.matrices, small)
    attention = slot_geometry(model, ["q_proj", "v_proj"], rank=16)
    with pytest.raises(SlotError, match=r"adapter recipe targets down_proj, gate_proj, up_proj .*export.lora_targets"):
        pack("recipe", recipe.config, recipe.matrices, attention)
    with pytest.raises(SlotError, match=r"export.lora_targets names lm_proj, which this model's decoder layers do not "
                                        r"have. Allowed: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        slot_geometry(model, ["q_proj", "lm_proj"], rank=8)
