"""The shape of the code: one pipeline whose stages declare their order, closed sets, moved modules, the tied
embedding decided in one place. Fast: no export runs here."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from exporters.config import TiedEmbeddingStorage
from exporters.export import build_stages, checked_config
from exporters.components.resolve import plan_export
from exporters.quant.tied import TiedEmbedding, plan_tied_embedding
from exporters.stages.pipeline import ExportContext, check_order, run_pipeline
from tests.helpers import REPO_ROOT, compose_config


def test_every_stage_declares_what_must_run_before_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stages = build_stages(plan_export(compose_config("bench=true")))
    assert [s.name for s in stages] == ["load", "baseline", "quantize", "capture", "lower", "emit", "validate",
                                        "advise", "finalize", "bench"]
    check_order(stages)
    pt2e = build_stages(plan_export(compose_config("quant=pt2e_xnnpack_static", "quant.allow_static_activations=true")))
    assert [s.name for s in pt2e][2:4] == ["quantize", "pt2e"]
    check_order(pt2e)
    with pytest.raises(ValueError, match="stage advise must run after validate"):
        check_order([s for s in stages if s.name != "validate"])
    with pytest.raises(ValueError, match="stage lower must run after capture"):
        check_order([s for s in stages if s.name != "capture"])
    with pytest.raises(ValueError, match="stage validate must run after baseline"):
        check_order([s for s in stages if s.name != "baseline"])


def test_stages_that_would_do_nothing_are_not_in_the_pipeline(tmp_path) -> None:  # type: ignore[no-untyped-def]
    names = [s.name for s in build_stages(plan_export(compose_config("validate=false")))]
    assert names == ["load", "quantize", "capture", "lower", "emit", "finalize"]
    no_warning = build_stages(plan_export(compose_config("validation.warn_ppl_increase=null")))
    assert "advise" not in [s.name for s in no_warning]


def test_stopping_after_a_stage_it_does_not_have_is_refused_before_anything_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = plan_export(compose_config("validate=false"))
    ctx = ExportContext(plan=plan, output_dir=tmp_path)
    with pytest.raises(ValueError, match="stop_after='validate' is not a stage of this export"):
        run_pipeline(build_stages(plan), ctx, stop_after="validate")
    assert not ctx.timings and not list(tmp_path.iterdir())


@pytest.mark.parametrize("old,new", [("exporters.quantization", "exporters.quant.schemes"),
                                     ("exporters.pipeline", "exporters.stages.pipeline"),
                                     ("exporters.bundle", "exporters.release.bundle"),
                                     ("exporters.internals", "exporters.program.internals"),
                                     ("exporters.stages.artifacts", "exporters.context.artifacts")])
def test_an_old_module_path_names_its_new_place(old: str, new: str) -> None:
    with pytest.raises(ModuleNotFoundError, match=f"{old} moved .* {new}"):
        importlib.import_module(old)


def test_every_module_imports_on_its_own() -> None:
    """No import cycle hides behind import order: each module imports first, in a fresh interpreter."""
    modules = sorted(str(p.relative_to(REPO_ROOT).with_suffix("")).replace("/", ".").removesuffix(".__init__")
                     for p in (REPO_ROOT / "exporters").rglob("*.py"))
    # A cycle shows only when one of its modules is imported first: forget every exporters module before each
    # import (torch and the other libraries stay loaded, so one interpreter does it in seconds).
    script = """import importlib, sys, traceback
for m in sys.argv[1:]:
    for name in [n for n in sys.modules if n == "exporters" or n.startswith("exporters.")]:
        del sys.modules[name]
    try:
        importlib.import_module(m)
    except Exception:
        print(m, traceback.format_exc(limit=3))
"""
    proc = subprocess.run([sys.executable, "-c", script, *modules], capture_output=True, text=True, cwd=REPO_ROOT)
    assert proc.returncode == 0 and not proc.stdout, proc.stdout[-2000:] + proc.stderr[-800:]


@pytest.mark.parametrize("overrides,storage,plan", [
    ({}, "shared", TiedEmbedding.SHARED),
    ({}, "copied", TiedEmbedding.COPIED),
    ({"linear": "8da4w", "lm_head": "8da4w"}, "shared", TiedEmbedding.UNTIED),
    ({"embedding": "8w", "embedding_group_size": 0, "lm_head": "8w", "lm_head_group_size": 0}, "shared",
     TiedEmbedding.QUANTIZED_ONCE),
    ({"embedding": "8w", "embedding_group_size": 32, "lm_head": "8w", "lm_head_group_size": 0}, "shared",
     TiedEmbedding.UNTIED),
    ({"lm_head_group_size": 64}, "shared", TiedEmbedding.SHARED),  # nothing quantized: group sizes do not matter
])
def test_the_tied_embedding_is_decided_in_one_place(tiny_checkpoint, overrides, storage, plan) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from models.checkpoint import build_model, open_checkpoint

    model = build_model(open_checkpoint(tiny_checkpoint), 64)
    quant = dataclasses.replace(checked_config(compose_config()).quant, **overrides)
    assert plan_tied_embedding(model, quant, TiedEmbeddingStorage(storage)) is plan


def test_the_plan_derives_each_length_once_and_every_stage_reads_it() -> None:
    """call_tokens is the cache length less one when max_seq_len reaches it, else max_seq_len; the methods' bounds,
    the cache's and validation's prompt come from the same plan."""
    from exporters.components.resolve import plan_export

    plan = plan_export(compose_config("export.max_seq_len=16", "export.max_context_len=64", "export.kv_dtype=int8"))
    lengths, decoder = plan.lengths, plan.main
    assert (lengths.context, lengths.max_seq_len, lengths.call_tokens, lengths.prefill_chunk) == (64, 16, 16, None)
    assert decoder.build.state.positions == 64 and decoder.build.state.call_tokens == lengths.call_tokens
    assert decoder.methods.specs["prefill"].max_tokens == lengths.call_tokens
    assert plan.validation is not None and plan.validation.eager_kv_dtype == "fp32"
    assert plan.validation.prompt_tokens == min(compose_config().validation.prompt_tokens, lengths.context // 2)
    whole = plan_export(compose_config("export.max_seq_len=32"))
    assert (whole.lengths.context, whole.lengths.call_tokens) == (32, 31)
    static = plan_export(compose_config("backend=coreml", "export.layout=split", "export.methods=[prefill,decode]",
                                        "export.prefill_chunk=8"))
    assert static.lengths.prefill_chunk == 8 and static.main.methods.specs["prefill"].max_tokens == 8
    assert static.keep_undelegated and static.validation is not None and not static.validation.in_runtime


def test_the_plan_digest_names_what_decides_the_program() -> None:
    """The same config gives the same digest wherever it is written; any field that changes the program changes it."""
    from exporters.components.resolve import plan_export

    base = plan_export(compose_config()).digest()
    assert plan_export(compose_config("export.output_dir=/tmp/elsewhere")).digest() == base
    assert plan_export(compose_config("quant=8da4w")).digest() != base
    assert plan_export(compose_config("export.max_seq_len=64")).digest() != base


def test_a_program_is_components_and_todays_is_one_decoder() -> None:
    from exporters.plan import ComponentKind
    from exporters.components.resolve import plan_export

    plan = plan_export(compose_config())
    assert [(c.name, c.kind) for c in plan.components] == [("decoder", ComponentKind.decoder)]
    assert plan.main.methods.aliases == {"forward": "prefill"} and plan.main.adapters == []


def test_each_kind_of_model_is_one_registered_module_and_the_stages_name_none() -> None:
    """A kind of model (decoder, adapters, slots, draft, assistant, vision encoder, speech) is one module of
    exporters.components implementing the protocol, registered once; the stages loop over the plan's parts and call it, so no stage's code
    names a kind (their docstrings may explain what the kinds do)."""
    import io
    import re
    import tokenize

    from exporters.components import KINDS, parts
    from exporters.components.kind import Kind
    from exporters.plan import ComponentKind

    assert list(KINDS) == ["decoder", "adapters", "slots", "draft", "assistant", "vision_encoder", "audio_encoder", "asr"]
    assert {k for k, kind in KINDS.items() if not kind.variant} == {str(k) for k in ComponentKind}
    for kind in KINDS.values():
        assert type(kind).__module__ == f"exporters.components.{type(kind).__module__.rsplit('.', 1)[-1]}"
        assert isinstance(kind, Kind)
    assert [p.name for p in parts(plan_export(compose_config()))] == ["decoder"]
    named = []
    for path in sorted((REPO_ROOT / "exporters" / "stages").glob("*.py")):
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            code = tok.type == tokenize.NAME or (tok.type == tokenize.STRING and not tok.string.startswith('"""'))
            if code and re.search(r"(^|\W|_)(draft|vision|swappable|slots|speech|whisper|asr)(_|\W|$)|ComponentKind", tok.string):
                named.append(f"{path.name}:{tok.start[0]}: {tok.string}")
    assert not named, named


def test_no_import_climbs_back_up_from_the_plan_types_or_the_program() -> None:
    """The plan's types, the program, quant and the runtime import nothing from the layers that use them (the kinds,
    the context, validation, the stages, the commands): the house has no circle."""
    import ast

    above = ("exporters.components", "exporters.context", "exporters.validation", "exporters.stages",
             "exporters.export", "exporters.sweeps", "exporters.llm", "exporters.generate")
    found = []
    for folder in ("plan", "program", "quant", "runtime", "output", "config"):
        for path in sorted((REPO_ROOT / "exporters" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(above):
                    found.append(f"{folder}/{path.name}:{node.lineno}: {node.module}")
    assert not found, found


def test_registries_keyed_by_a_closed_set_cover_exactly_that_set() -> None:
    from exporters.config import Algorithm, DType, Pt2eQuantizer, exhaustive
    from exporters.quant.pt2e import PT2E_QUANTIZERS
    from exporters.quant.schemes import DATA_FREE, DTYPES

    exhaustive(Pt2eQuantizer, PT2E_QUANTIZERS, "PT2E_QUANTIZERS")
    assert set(DTYPES) == {str(d) for d in DType} and set(DATA_FREE) == {str(a) for a in Algorithm if a.data_free}
    with pytest.raises(AssertionError, match=r"differ: \['bf16'\]"):
        exhaustive(DType, {"fp32": 1, "fp16": 2}, "a registry")


def test_another_executorch_takes_the_stock_path_and_says_so_once(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """Shortcuts through private internals are only taken with the versions they were read in."""
    import logging

    from exporters.program import versions
    from exporters.components.resolve import plan_export

    assert versions.shortcuts_allowed(True) and not versions.shortcuts_allowed(False)
    assert plan_export(compose_config()).shortcuts
    monkeypatch.setattr(versions, "installed", lambda name: "9.9.9")
    versions._warn_unchecked.cache_clear()
    with caplog.at_level(logging.WARNING, logger="exporters"):
        plan = plan_export(compose_config())
        assert not versions.shortcuts_allowed(True)
    assert not plan.shortcuts and not plan.main.quant.shortcuts and plan.main.methods.aliases == {}
    warned = [r for r in caplog.records if "stock path" in r.getMessage()]
    assert len(warned) == 1 and f"executorch 9.9.9 (checked: {versions.EXECUTORCH})" in warned[0].getMessage()
    versions._warn_unchecked.cache_clear()
