"""LoRA adapters (``model.adapters``): real PEFT adapters become methods of one program over one stored base.

The adapters are trained by PEFT on the truncated real SmolLM2 (``tests/peft_adapters.py``). Our decoder with an
adapter attached must compute what PEFT's ``PeftModel`` computes (and its merged weights); the program's adapter
methods must match that eager model in the runtime and generate its text; a program whose adapter methods ignore
the adapter must fail validation; every kind of bad adapter folder is refused before any long stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exporters.errors import REPORTED_ERRORS, UserError, ValidationFailed
from exporters.export import export
from exporters.program.internals import read_data_file_header
from exporters.program.weights import DataFileError
from exporters.release.bundle import make_bundle
from exporters.runtime.driver import Driver
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.programs import LoadedProgram
from exporters.stages import capture
from models.decoder import CausalLM
from models.lora import active_adapter, attach_adapters, read_adapter
from models.tokenizer import load_tokenizer
from tests.helpers import compose_config
from tests.peft_adapters import OTHER_TEXT, RECIPES, AdapterRecipe, train_adapter

PROMPT = "The ship sails at"


def adapters_override(folders: dict[str, Path], *names: str) -> str:
    return "+model.adapters={" + ", ".join(f"{n}: {folders[n]}" for n in names) + "}"


def our_model(checkpoint: Path, folders: dict[str, Path], quant: str | None = None) -> CausalLM:
    """Our decoder with the adapters attached, built apart from the pipeline (quantized like ``quant``)."""
    from exporters.config import QuantConfig, quant_option
    from exporters.quant.apply import quantize_model
    from models.checkpoint import build_model, open_checkpoint

    model = build_model(open_checkpoint(checkpoint), 256)
    attach_adapters(model, [read_adapter(name, folder, model) for name, folder in folders.items()])
    if quant is not None:
        quantize_model(model, quant_option(quant) if isinstance(quant, str) else QuantConfig(**quant))
    return model


def logits_of(model: CausalLM, tokens: torch.Tensor, adapter: str | None) -> torch.Tensor:
    with torch.no_grad(), active_adapter(model, adapter):
        out = model(tokens, torch.tensor([0]), full_logits=True)[0].float()
    model.reset_cache()
    return out


def text_tokens(checkpoint: Path) -> torch.Tensor:
    return torch.tensor([load_tokenizer(checkpoint / "tokenizer.json").encode(OTHER_TEXT)[:24]])


def test_our_decoder_with_an_adapter_computes_what_peft_computes(smollm2_truncated: Path, lora_adapters) -> None:  # type: ignore[no-untyped-def]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ours = our_model(smollm2_truncated, lora_adapters)
    tokens = text_tokens(smollm2_truncated)
    base = logits_of(ours, tokens, None)
    for name, folder in lora_adapters.items():
        hf = AutoModelForCausalLM.from_pretrained(str(smollm2_truncated), dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(hf, str(folder)).eval()
        with torch.no_grad():
            reference = peft_model(tokens).logits[0]
            merged = peft_model.merge_and_unload()(tokens).logits[0]
        adapted = logits_of(ours, tokens, name)
        assert torch.allclose(adapted, reference, atol=1e-4), (adapted - reference).abs().max()
        assert torch.allclose(adapted, merged, atol=1e-3), (adapted - merged).abs().max()
        # The adapter matters: it moves the logits measurably.
        assert (adapted - base).abs().max() > 0.1
    pirate, minutes = (logits_of(ours, tokens, n) for n in ("pirate", "minutes"))
    assert (pirate - minutes).abs().max() > 0.1, "the two adapters pull the base different ways"


def with_adapters(exported, tiny_checkpoint: Path, tiny_adapters):  # type: ignore[no-untyped-def]
    """The tiny model in fp32 with a real adapter on every kind of linear layer (rsLoRA, ``every``): fp32, where the
    program computes what the eager model computes to rounding, so greedy tokens can be compared; the default methods,
    so the base alone is the program tests/test_swappable_adapters.py compares its zero slots with. (Several adapters
    in one program: the 8da4w programs below, each adapter's methods a lowering of their own.)"""
    return exported("model=llama", f"model.checkpoint={tiny_checkpoint}", "quant=fp32",
                    adapters_override(tiny_adapters, "every"))


def test_one_program_holds_the_base_and_each_adapter_with_the_base_stored_once(exported, tiny_checkpoint: Path,  # type: ignore[no-untyped-def]
                                                                                tiny_adapters) -> None:
    both = with_adapters(exported, tiny_checkpoint, tiny_adapters)
    alone = exported()  # the default export: the tiny model whose files tiny_checkpoint holds, fp32, no adapter
    m = both.manifest
    assert m.ok and m.passed and m.validation is not None and m.validation.checked == "runtime"
    entry = m.adapters["every"]
    assert entry.methods == {b: f"every_{b}" for b in ("prefill", "decode_one_token", "forward")}
    assert set(entry.methods.values()) <= set(m.methods)
    assert entry.validation is not None and entry.validation.passed and entry.validation.checked == "runtime"
    assert entry.validation.methods["prompt"] == "every_prefill" and entry.dtype == "float32"
    # Validated against the eager model with this adapter: its unquantized perplexity is not the base's.
    assert entry.validation.baseline_perplexity != m.validation.baseline_perplexity
    assert entry.use_rslora and entry.layers == 14  # 7 kinds of linear layer in each of 2 layers
    assert LoadedProgram(both.pte_path).constant("get_adapters") == "every"
    # The base weights are stored once: the adapter adds its own fp32 matrices (and graphs), nothing more.
    adapter = load_file(str(tiny_adapters["every"] / "adapter_model.safetensors"))
    adapter_bytes = sum(t.numel() * 4 for t in adapter.values())
    storage, plain = both.manifest.program.storage, alone.manifest.program.storage
    extra_weights = (storage["named_data_bytes"] + storage["constant_buffer_bytes"]
                     - plain["named_data_bytes"] - plain["constant_buffer_bytes"])
    assert 0.9 * adapter_bytes <= extra_weights <= 1.1 * adapter_bytes


def test_each_adapters_methods_generate_the_eager_adapters_tokens(exported, tiny_checkpoint: Path,  # type: ignore[no-untyped-def]
                                                                  tiny_adapters) -> None:
    """Greedy tokens of each adapter's methods equal the eager model's with that adapter. (Quantized adapter programs
    are held to their scheme's tolerances by validation: test_adapters_can_be_stored_in_8_bits.)"""
    result = with_adapters(exported, tiny_checkpoint, tiny_adapters)
    eager = our_model(tiny_checkpoint, {"every": tiny_adapters["every"]})
    texts = {}
    for adapter in (None, "every"):
        ours = Generator(result.pte_path, adapter=adapter).generate(PROMPT, SamplingConfig(max_new_tokens=8))
        ids = list(ours.prompt_ids)
        for _ in range(8):  # the eager model's greedy tokens, the whole sequence recomputed at each step
            ids.append(int(logits_of(eager, torch.tensor([ids]), adapter)[-1].argmax()))
        assert ours.new_ids == ids[len(ours.prompt_ids):], adapter
        texts[adapter] = ours.text
    assert len(set(texts.values())) == 2, texts


@pytest.mark.slow  # a real export of its own (34 s of the fast tier's 177 s on 2026-11-28)
def test_adapter_methods_that_ignore_the_adapter_fail_validation(tiny_checkpoint, tiny_adapters, tmp_path: Path,
                                                                 monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Negative control: capture the adapter's methods from the base (as a broken exporter would). The tiny model:
    what fails is the comparison of the adapter's methods with the eager model, whatever the weights."""
    monkeypatch.setattr(capture, "active_adapter", lambda model, name: active_adapter(model, None))
    cfg = compose_config("model=llama", f"model.checkpoint={tiny_checkpoint}", "export.methods=[decode]",
                         "export.layout=split", adapters_override(tiny_adapters, "pirate"))
    with pytest.raises(ValidationFailed, match=r"adapter pirate's methods: FAILED \(KL"):
        export(cfg, tmp_path)
    assert not (tmp_path / "model.pte").exists() and (tmp_path / "model.rejected.pte").is_file()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["status"] == "failed validation" and manifest["validation"]["passed"]
    assert not manifest["adapters"]["pirate"]["validation"]["passed"]


def tiny_exported(exported, tiny_adapters: dict[str, Path], *overrides: str, pirate: str = "pirate",  # type: ignore[no-untyped-def]
                  minutes: bool = True):
    """8da4w, each adapter in its own data file, one graph per adapter (the storage is the point: the tiny model)."""
    adapters = f"pirate: {tiny_adapters[pirate]}" + (f", minutes: {tiny_adapters['minutes']}" if minutes else "")
    return exported("quant=8da4w", "export.weights=external", "export.methods=[decode]", "export.layout=split",
                    f"+model.adapters={{{adapters}}}", *overrides)


@pytest.mark.extended  # about 60 s: XNNPACK's 8-bit kernels are run by other entries; the adapter storage is the point
def test_adapters_can_be_stored_in_8_bits(exported, tiny_adapters) -> None:  # type: ignore[no-untyped-def]
    """quant.adapters=8da8w beside an 8da4w base: smaller adapters, still validated. (One adapter: the scheme
    applies per matrix, and each adapter's graph costs a lowering.)"""
    full = tiny_exported(exported, tiny_adapters)
    eight = tiny_exported(exported, tiny_adapters, "quant.adapters=8da8w", minutes=False)
    for result in (full, eight):
        assert result.manifest.passed and all(a.validation.checked == "runtime" for a in result.manifest.adapters.values())
    applied = eight.manifest.quantization.adapters
    # A and B of every linear layer the adapter changes
    assert applied is not None and applied.scheme == "8da8w" and len(applied.layers) == 2 * eight.manifest.adapters["pirate"].layers
    assert set(applied.layers.values()) == {0}, "one scale per row"
    assert full.manifest.quantization.adapters is None
    fp32, int8 = full.manifest.adapters["pirate"], eight.manifest.adapters["pirate"]
    assert (fp32.dtype, int8.dtype) == ("float32", "8da8w")
    assert int8.data.size_bytes < 0.5 * fp32.data.size_bytes  # type: ignore[union-attr]
    assert eight.manifest.program.sha256 != full.manifest.program.sha256


def test_with_external_weights_each_adapter_has_its_own_data_file_that_can_be_swapped(  # type: ignore[no-untyped-def]
        exported, tiny_adapters, tiny_checkpoint: Path, tmp_path: Path) -> None:
    """export.weights=external: the base's weights in model.ptd, each adapter's A and B in model.<adapter>.ptd.
    The adapter retrained (same name, ranks, targets) and exported again gives the same program bytes and a new
    adapter file, which beside the first program makes its adapter methods compute the new adapter."""
    first = tiny_exported(exported, tiny_adapters)
    second = tiny_exported(exported, tiny_adapters, pirate="retrained")
    run, m = first.pte_path.parent, first.manifest
    assert m.passed and m.data is not None and m.data.file == "model.ptd"
    for name in ("pirate", "minutes"):
        entry = m.adapters[name]
        assert entry.data is not None and entry.data.file == f"model.{name}.ptd" and entry.validation.checked == "runtime"
        keys = [e.key for e in read_data_file_header(run / entry.data.file).named_data]
        assert len(keys) == entry.data.entries == 2 * entry.layers and all(".lora_" in k and f".{name}." in k for k in keys)
    assert not [e.key for e in read_data_file_header(run / "model.ptd").named_data if ".lora_" in e.key]
    assert "--data_paths=model.ptd,model.pirate.ptd" in m.runtime.load

    # The retrained adapter: the same program and base weights, another pirate file.
    assert second.manifest.program.sha256 == m.program.sha256 and second.manifest.data.sha256 == m.data.sha256
    assert second.manifest.adapters["minutes"].data.sha256 == m.adapters["minutes"].data.sha256
    assert second.manifest.adapters["pirate"].data.sha256 != m.adapters["pirate"].data.sha256
    tokens = text_tokens(tiny_checkpoint)[:, :8]

    def pirate_logits(data_files: list[Path]) -> torch.Tensor:
        driver = Driver.of(LoadedProgram(first.pte_path, data_paths=data_files), "pirate")
        return torch.stack([driver.decode_one_token(int(t), i).clone() for i, t in enumerate(tokens[0])])

    original = pirate_logits([run / "model.ptd", run / "model.pirate.ptd"])
    swapped = pirate_logits([run / "model.ptd", second.pte_path.parent / "model.pirate.ptd"])
    new = Driver.of(LoadedProgram(second.pte_path), "pirate")
    assert torch.equal(swapped, torch.stack([new.decode_one_token(int(t), i).clone() for i, t in enumerate(tokens[0])]))
    assert not torch.allclose(swapped, original, atol=1e-3)
    # XNNPACK's weight cache finds packed weights by name: while the retrained adapter's program is loaded, one
    # with the first adapter under the same names is refused (it would run with the retrained one's weights).
    with pytest.raises(UserError, match="names its weights as .*model.pirate.ptd does"):
        pirate_logits([run / "model.ptd", run / "model.pirate.ptd"])
    del new

    # An app ships the adapters it uses: without model.minutes.ptd the base and pirate still load and run.
    shipped = tmp_path / "shipped"
    shutil.copytree(run, shipped, ignore=shutil.ignore_patterns("checkpoint", "model.minutes.ptd"))
    assert [p.name for p in Generator(shipped, adapter="pirate").program.data_paths] == ["model.ptd", "model.pirate.ptd"]
    with pytest.raises(DataFileError, match=r"model.minutes.ptd, which is missing"):
        Generator(shipped, adapter="minutes")
    # A release bundle carries every adapter's file and says how to switch and update them.
    bundle, _ = make_bundle(run, tmp_path / "release")
    assert {"model.ptd", "model.pirate.ptd", "model.minutes.ptd"} <= {p.name for p in bundle.iterdir()}
    assert "`pirate`: `model.pirate.ptd`" in (bundle / "README.md").read_text()
    assert torch.equal(pirate_logits([bundle / "model.ptd", bundle / "model.pirate.ptd"]), original)
    # The portable backend cannot keep adapters apart (ExecuTorch names its folded weights per method).
    with pytest.raises(UserError, match=r"model.adapters \(pirate\) on backend=portable: ExecuTorch 1.5.1 folds"):
        export(compose_config("backend=portable", "export.weights=external",
                              f"+model.adapters={{pirate: {tiny_adapters['pirate']}}}"),
               tmp_path / "portable")
    assert not list((tmp_path / "portable").glob("*.pt*"))


@pytest.fixture(scope="module")
def bad_folders(lora_adapters, tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path,
                family_checkpoint, smollm2_truncated: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Adapter folders that must be refused, each made the way a user could end up with it."""
    from peft import IA3Config, LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bad_adapters")
    folders = {}
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_truncated), dtype=torch.float32)
    get_peft_model(hf, IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                                 task_type="CAUSAL_LM")).save_pretrained(str(root / "ia3"))
    folders["ia3"] = root / "ia3"
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_truncated), dtype=torch.float32)
    get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True,
                                  task_type="CAUSAL_LM")).save_pretrained(str(root / "dora"))
    folders["dora"] = root / "dora"
    folders["missing"] = Path(shutil.copytree(lora_adapters["pirate"], root / "missing"))
    (folders["missing"] / "adapter_model.safetensors").unlink()
    folders["corrupt"] = Path(shutil.copytree(lora_adapters["pirate"], root / "corrupt"))
    weights = folders["corrupt"] / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    recipe = AdapterRecipe(RECIPES["pirate"].text, ("q_proj", "v_proj"), steps=1)
    folders["other_size"] = train_adapter(tiny_checkpoint, root / "other_size", recipe)  # a llama of hidden 64
    fused = AdapterRecipe(RECIPES["pirate"].text, ("qkv_proj",), steps=1)
    folders["other_family"] = train_adapter(family_checkpoint("phi3"), root / "other_family", fused)
    return folders


@pytest.mark.parametrize("case,message", [
    ("ia3", r"model.adapters.bad=.*ia3: it is a IA3 adapter, not LoRA. Only LoRA adapters"),
    ("dora", r"use_dora=True \(DoRA \(a learned magnitude per output\)\) is not supported.*merge_and_unload"),
    ("missing", r"no adapter_model.safetensors. Save the adapter with safe_serialization=True"),
    ("corrupt", r"adapter_model.safetensors cannot be read .*damaged or incomplete"),
    ("other_size", r"its model.layers.0.self_attn.q_proj matrices are A \[8, 64\], B \[64, 8\]; this base's layer is "
                   r"576 x 576.*trained for another base model of the same family"),
    ("other_family", r"it targets 2 module\(s\) the base does not have, e.g. model.layers.0.self_attn.qkv_proj"),
])
def test_a_bad_adapter_is_refused_before_the_long_stages(bad_folders, smollm2_truncated: Path, tmp_path: Path,
                                                         case: str, message: str) -> None:
    cfg = compose_config("model=llama", f"model.checkpoint={smollm2_truncated}",
                         f"+model.adapters={{bad: {bad_folders[case]}}}")
    with pytest.raises(REPORTED_ERRORS, match=message):
        export(cfg, tmp_path)
    assert not list(tmp_path.glob("*.pte")) and not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("override,message", [
    ("+model.adapters={my-chat: /tmp}", r"the adapter name 'my-chat' cannot name methods"),
    ("+model.adapters={chat: /no/such/folder}", r"model.adapters.chat=/no/such/folder: no such folder"),
])
def test_adapter_names_and_folders_are_checked_with_the_config(override: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(REPORTED_ERRORS, match=message):
        export(compose_config(override), tmp_path)


def test_two_adapters_of_one_name_on_the_command_line_are_refused() -> None:
    from models.lora import AdapterError, check_adapter_overrides

    with pytest.raises(AdapterError, match=r"model.adapters names chat more than once"):
        check_adapter_overrides(["model=llama", "+model.adapters={chat: /a, summary: /b, chat: /c}"])
    check_adapter_overrides(["+model.adapters={chat: /a, summary: /b}"])


@pytest.mark.extended  # about 40 s; the adapter's rotation is checked exactly and eagerly in tests/test_rotation.py
def test_a_rotated_program_keeps_each_adapter_in_its_own_data_file_and_validates(exported, tiny_adapters) -> None:  # type: ignore[no-untyped-def]
    """quant.rotation with adapters and external weights: the adapter's A and B turned with their layers (A by the
    layer's input rotation, B by its output's), written to its own data file, validated in the runtime."""
    result = tiny_exported(exported, tiny_adapters, "quant.rotation=hadamard", "quant.online_hadamard=true",
                           minutes=False)
    m = result.manifest
    assert m.passed and m.quantization.rotation is not None and m.data is not None
    pirate = m.adapters["pirate"]
    assert pirate.validation.passed and pirate.validation.checked == "runtime" and pirate.data is not None
