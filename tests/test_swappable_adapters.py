"""Swappable adapters (``export.adapters=swappable``): one set of the base's methods whose LoRA matrices are state
an app writes with ``set_adapter``; any PEFT adapter whose targets and ranks fit is data (``models.lora_slots``).

Eagerly, the four adapters PEFT trains on the truncated real SmolLM2 (``tests/peft_adapters.py``: attention, every
linear with rsLoRA, MLP only, per-layer ranks and alphas) laid out in the slots compute what PEFT computes. The
programs are the tiny model's (seconds to export), run in the runtime against transformers + PEFT.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from exporters.errors import UserError
from exporters.program.internals import read_tensor_file
from exporters.components.resolve import plan_export
from exporters.release.bundle import make_bundle, verify_bundle
from exporters.runtime.driver import Driver
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.swap import Slots
from models.checkpoint import build_model, open_checkpoint
from models.lora import active_adapter, attach_adapters, read_adapter
from models.lora_slots import SET_ADAPTER, SlotError, attach_slots, pack, slot_geometry
from models.tokenizer import load_tokenizer
from tests.helpers import compose_config
from tests.peft_adapters import OTHER_TEXT, RECIPES, AdapterRecipe, train_adapter

PROMPT = "The meeting"

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

    # In 8 bits (quant.adapters=8w): int8 codes and a scale per row, which set_adapter multiplies back into the
    # slots; about a thousandth of each adapter's effect on the logits.
    eight_bit = dataclasses.replace(geometry, stored="int8")
    for adapter in adapters:
        peft = logits(adapter.name)
        packed = pack(adapter.name, adapter.config, adapter.matrices, eight_bit)
        assert list(packed) == eight_bit.input_names() and packed["q_proj.A"].dtype == torch.int8
        slots.load({name: packed[name].float() * packed[f"{name}.scale"] for name in geometry.input_names()})
        assert (logits() - peft).abs().max() < 5e-3 * (peft - base).abs().max(), adapter.name
        slots.load(geometry.zeros())


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


# ---- Programs: one set of the base's methods, the adapter an app sets ----

def swappable(exported, tiny_checkpoint: Path, tiny_adapters, *overrides: str):  # type: ignore[no-untyped-def]
    """The tiny model with slots of pirate's rank (8) on q, k, v and down: pirate (q, v, down) and minutes (q, v) are
    given, k's slots are for adapters to come (a layer no given adapter wraps); ``quant=fp32`` unless given."""
    return exported("model=llama", f"model.checkpoint={tiny_checkpoint}", "export.adapters=swappable",
                    "export.lora_targets=[q_proj,k_proj,v_proj,down_proj]",
                    f"+model.adapters={{pirate: {tiny_adapters['pirate']}, minutes: {tiny_adapters['minutes']}}}",
                    *(overrides or ("quant=fp32",)))


def decode_logits(program: LoadedProgram, tokens: torch.Tensor) -> torch.Tensor:
    """The prompt through prefill, then each token through decode: every logit the program gives, stacked."""
    driver = Driver.of(program)
    rows = [driver.prefill(tokens[:, :6]).reshape(-1).clone()]
    rows += [driver.decode_one_token(int(t), 6 + i).reshape(-1).clone() for i, t in enumerate(tokens[0, 6:-1])]
    return torch.stack(rows)


def peft_logits(checkpoint: Path, folder: Path | None, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' model of the checkpoint with PEFT's adapter on it (None: without), for the same calls."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    if folder is not None:
        model = PeftModel.from_pretrained(model, str(folder))
    with torch.no_grad():
        logits = model(tokens).logits[0]
    return logits[5:-1]


def test_one_set_of_methods_computes_with_the_adapter_the_app_sets(exported, tiny_checkpoint: Path,  # type: ignore[no-untyped-def]
                                                                   tiny_adapters, tmp_path: Path) -> None:
    result = swappable(exported, tiny_checkpoint, tiny_adapters)
    m, run = result.manifest, result.pte_path.parent
    assert m.passed and m.swappable is not None and m.swappable.method == SET_ADAPTER
    assert m.swappable.slots["rank"] == 8 and [t["kind"] for t in m.swappable.slots["targets"]] == [
        "q_proj", "k_proj", "v_proj", "down_proj"]
    assert [s.name for s in m.swappable.inputs] == ["q_proj.A", "q_proj.B", "k_proj.A", "k_proj.B", "v_proj.A",
                                                    "v_proj.B", "down_proj.A", "down_proj.B"]
    assert m.swappable.inputs[6].shape == [2, 1, 192, 8] and m.swappable.inputs[7].shape == [2, 1, 8, 64]
    assert m.methods[SET_ADAPTER].tokens == [0, 0] and len(m.methods[SET_ADAPTER].inputs) == len(m.swappable.inputs)
    program = LoadedProgram(result.pte_path)
    assert not [n for n in program.method_names if n.startswith(("pirate_", "minutes_"))], "no methods per adapter"
    for name in ("pirate", "minutes"):
        entry = m.adapters[name]
        assert entry.validation is not None and entry.validation.passed and entry.validation.checked == "runtime"
        assert entry.methods == {b: b for b in ("prefill", "decode_one_token", "forward")}
        assert (run / m.swappable.adapters[name].file) == run / "adapters" / f"{name}.ptd"
        assert read_tensor_file(run / "adapters" / f"{name}.ptd").keys() == {s.name for s in m.swappable.inputs}

    # All zeros (how the program starts, and after set_adapter of zeros) is the program without slots, bit for bit.
    tokens = torch.tensor([load_tokenizer(tiny_checkpoint / "tokenizer.json").encode(OTHER_TEXT)[:14]])
    plain = exported("model=llama", f"model.checkpoint={tiny_checkpoint}", "quant=fp32")
    base = decode_logits(LoadedProgram(plain.pte_path), tokens)
    assert torch.equal(decode_logits(program, tokens), base)
    slots = Slots(program, run)
    for name in ("pirate", "minutes"):  # each as PEFT computes it on transformers' model
        slots.set(name)
        torch.testing.assert_close(decode_logits(program, tokens), peft_logits(tiny_checkpoint, tiny_adapters[name],
                                                                               tokens), atol=1e-4, rtol=1e-4)
    slots.set(None)
    assert torch.equal(decode_logits(program, tokens), base)
    # A release bundle carries the adapters' files and says how an app sets them.
    bundle, archive = make_bundle(run, tmp_path / "release")
    assert (bundle / "adapters" / "pirate.ptd").is_file() and not verify_bundle(bundle) and not verify_bundle(archive)
    readme = (bundle / "README.md").read_text()
    assert "## LoRA adapters, swapped at run time" in readme and "FlatTensorDataMap" in readme


def test_an_adapter_trained_after_the_export_loads_and_matches_peft(exported, tiny_checkpoint: Path, tiny_adapters,  # type: ignore[no-untyped-def]
                                                                    tmp_path: Path) -> None:
    """PEFT trains an adapter the export never saw (on q and k, whose slots no given adapter used; rank 4 under the
    slots' 8, rsLoRA); the adapter command writes it for the program; generate's greedy tokens are transformers +
    PEFT's."""
    from exporters.adapter import main as adapter_main

    result = swappable(exported, tiny_checkpoint, tiny_adapters)
    later = train_adapter(tiny_checkpoint, tmp_path / "later", AdapterRecipe(
        RECIPES["legal"].text, ("q_proj", "k_proj"), r=4, lora_alpha=8, use_rslora=True, steps=4, seed=7))
    out = tmp_path / "later.ptd"
    assert adapter_main([str(result.pte_path.parent), str(later), f"out={out}"]) == 0 and out.is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint)), str(later))
    for adapter in (str(out), str(later)):  # the file, and the PEFT folder packed on the fly
        generated = Generator(result.pte_path.parent, adapter=adapter).generate(PROMPT, SamplingConfig(max_new_tokens=8))
        ids = torch.tensor([generated.prompt_ids])
        expected = reference.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert generated.new_ids == expected, adapter


def test_a_bad_adapter_is_refused_and_the_program_keeps_the_one_it_had(exported, tiny_checkpoint: Path,  # type: ignore[no-untyped-def]
                                                                      tiny_adapters, family_checkpoint,
                                                                      tmp_path: Path) -> None:
    from exporters.program.internals import write_tensor_file

    result = swappable(exported, tiny_checkpoint, tiny_adapters)
    run = result.pte_path.parent
    program = LoadedProgram(result.pte_path)
    slots = Slots(program, run)
    slots.set("pirate")
    tokens = torch.tensor([load_tokenizer(tiny_checkpoint / "tokenizer.json").encode(OTHER_TEXT)[:10]])
    kept = decode_logits(program, tokens)
    text = RECIPES["pirate"].text
    pirate = read_tensor_file(run / "adapters" / "pirate.ptd")
    write_tensor_file({k: v.half() for k, v in pirate.items()}, tmp_path / "half.ptd")
    cut = (run / "adapters" / "pirate.ptd").read_bytes()
    (tmp_path / "cut.ptd").write_bytes(cut[:len(cut) - 100])
    cases = {
        str(train_adapter(tiny_checkpoint, tmp_path / "big", AdapterRecipe(text, ("q_proj",), r=16, steps=1))):
            r"rank 16 on model.layers.0.self_attn.q_proj, above the program's export.lora_max_rank=8. Export the "
            r"program again with export.lora_max_rank=16 or more, or train the adapter with r<=8",
        str(train_adapter(tiny_checkpoint, tmp_path / "mlp", AdapterRecipe(text, ("gate_proj", "up_proj"), steps=1))):
            r"targets gate_proj, up_proj .* Export the program again with export.lora_targets including gate_proj, "
            r"up_proj",
        str(train_adapter(family_checkpoint("qwen3"), tmp_path / "qwen3", AdapterRecipe(text, ("v_proj",), steps=1))):
            r"v_proj has A \[8, 64\] and B \[16, 8\]; the program's layer is 32 x 64. The adapter was trained for "
            r"another base model",
        str(tmp_path / "half.ptd"): r"q_proj.A is float16 \[2, 1, 64, 8\], and this program's set_adapter takes "
                                    r"float32 \[2, 1, 64, 8\]",
        str(tmp_path / "cut.ptd"): r"cut.ptd is not a whole ExecuTorch data file \(.ptd\): .* it was cut short",
        "legal": r"adapter=legal is neither an adapter of this program nor a .ptd file nor a PEFT folder. The "
                 r"program's own adapters: minutes, pirate",
    }
    for adapter, message in cases.items():
        with pytest.raises((SlotError, UserError), match=message):
            slots.set(adapter)
        assert slots.current == "pirate" and torch.equal(decode_logits(program, tokens), kept), adapter


def test_a_quantized_base_with_external_weights_takes_8_bit_swapped_adapters(exported, tiny_checkpoint: Path,  # type: ignore[no-untyped-def]
                                                                              tiny_adapters) -> None:
    """8da4w, the base's weights in model.ptd, the adapters' matrices in 8 bits (quant.adapters=8w): each adapter
    validated in the runtime against the quantized base with PEFT's adapter as trained, as the methods mode validates
    its adapter methods; the adapters' files about a quarter of the float ones (a third at these tiny shapes), not
    data files of the program."""
    result = swappable(exported, tiny_checkpoint, tiny_adapters, "quant=8da4w", "export.weights=external",
                       "quant.adapters=8w")
    m = result.manifest
    assert m.swappable is not None and m.swappable.slots["stored"] == "int8"
    assert [(s.name, s.dtype) for s in m.swappable.inputs[:2]] == [("q_proj.A", "int8"), ("q_proj.A.scale", "float32")]
    pirate = read_tensor_file(result.pte_path.parent / m.swappable.adapters["pirate"].file)
    assert pirate["q_proj.A"].dtype == torch.int8 and m.swappable.adapters["pirate"].size_bytes < 0.4 * sum(
        t.numel() * 4 for name, t in pirate.items() if not name.endswith(".scale"))
    assert m.passed and m.data is not None and m.data.file == "model.ptd" and m.runtime.load.count(".ptd") >= 1
    assert "adapters/" not in m.runtime.load
    # q, k and v (dynamically quantized, one input) with slots stay one XNNPACK partition with the rest of the layer:
    # one delegate call per layer and one for the head, as without slots (products_after_projections).
    assert m.methods["decode_one_token"].delegated_partitions == 2 + 1
    for name in ("pirate", "minutes"):
        report = m.adapters[name].validation
        assert report is not None and report.checked == "runtime" and report.passed
        assert report.baseline_perplexity != m.validation.baseline_perplexity  # type: ignore[union-attr]
        assert report.perplexity != m.validation.perplexity  # type: ignore[union-attr]
    generated = Generator(result.pte_path.parent, adapter="pirate").generate(PROMPT, SamplingConfig(max_new_tokens=6))
    assert len(generated.new_ids) == 6


@pytest.mark.parametrize("overrides, named", [
    (["quant=8da4w_rotated"], r"quant.rotation / quant.online_hadamard: a rotated base"),
    (["quant=pt2e_xnnpack_dynamic"], r"quant.pt2e=xnnpack_dynamic"),
    (["quant.adapters=8da8w"], r"quant.adapters=8da8w"),
    (["backend=vulkan", "quant=fp32"], r"backend=vulkan: a swapped adapter is validated in this machine's runtime"),
    (["export.lora_max_rank=4"], r"model.adapters.pirate has rank 8 \(on down_proj, q_proj, v_proj\), above "
                                 r"export.lora_max_rank=4"),
    (["export.lora_targets=[q_proj,v_proj]"], r"model.adapters.pirate changes down_proj, and export.lora_targets is "
                                              r"\[q_proj, v_proj\]"),
])
def test_what_swappable_slots_cannot_take_is_refused_before_any_work(tiny_checkpoint: Path, tiny_adapters,  # type: ignore[no-untyped-def]
                                                                     overrides: list[str], named: str) -> None:
    cfg = compose_config("model=llama", f"model.checkpoint={tiny_checkpoint}", "export.adapters=swappable",
                         f"+model.adapters={{pirate: {tiny_adapters['pirate']}}}", *overrides)
    with pytest.raises(UserError, match=named):
        plan_export(cfg)
