"""Real exports of the tiny model, each .pte run in the ExecuTorch runtime.

The reference for fp32 is transformers' own LlamaForCausalLM on the same checkpoint (independent of
our decoder); for quantized exports it is our eager model with the same torchao quantization.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
import torch

from exporters.context.artifacts import ExportResult
from exporters.errors import UserError
from exporters.manifest import Manifest
from exporters.runtime.programs import LoadedProgram
from tests.helpers import eager_model_of

PAIRS = [("portable", "fp32"), ("xnnpack", "fp32"), ("xnnpack", "8da4w")]
CONSTANTS = {"get_max_seq_len", "get_max_context_len", "get_vocab_size", "get_bos_id", "get_eos_ids",
             "get_n_layers", "use_kv_cache", "enable_dynamic_shape"}
PROMPT_LEN, DECODE_STEPS = 10, 12


def export_pair(exported, backend: str, quant: str) -> ExportResult:  # type: ignore[no-untyped-def]
    return exported(f"backend={backend}", f"quant={quant}")


def eager_reference(result: ExportResult, quant: str):  # type: ignore[no-untyped-def]
    """The model the export must match: transformers for fp32, our quantized eager model otherwise."""
    ckpt_dir = result.pte_path.parent / "checkpoint"
    if quant == "fp32":
        from transformers import LlamaForCausalLM

        ref = LlamaForCausalLM.from_pretrained(str(ckpt_dir), torch_dtype=torch.float32).eval()
        return lambda tokens: ref(tokens).logits[0]
    model = eager_model_of(result)

    def full_sequence(tokens: torch.Tensor) -> torch.Tensor:
        model.reset_cache()
        return model(tokens, torch.tensor([0]), full_logits=True)[0]

    return full_sequence


@pytest.mark.parametrize("backend,quant", PAIRS)
def test_program_has_methods_and_constants(exported, backend: str, quant: str) -> None:
    result = export_pair(exported, backend, quant)
    program = LoadedProgram(result.pte_path)
    methods = {"prefill", "decode_one_token", "forward"}
    assert program.method_names == methods | CONSTANTS | {f"get_{m}_max_tokens" for m in methods}
    expected = {
        "get_max_seq_len": 128, "get_max_context_len": 128, "get_vocab_size": 384, "get_bos_id": 1,
        "get_n_layers": 2, "use_kv_cache": True, "enable_dynamic_shape": True,
    }
    for name, value in expected.items():
        assert program.constant(name) == value, name
    assert program.constant("get_eos_ids") == 2  # a one-element list comes back as its element
    assert result.manifest.constant_methods["get_eos_ids"] == [2]


@pytest.mark.parametrize("backend,quant", PAIRS)
def test_prefill_then_decode_continue_one_sequence(exported, backend: str, quant: str) -> None:
    """Prefill writes the shared KV cache, decode steps read it: logits match the reference at every step."""
    result = export_pair(exported, backend, quant)
    reference = eager_reference(result, quant)
    program = LoadedProgram(result.pte_path)
    tokens = torch.randint(3, 384, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    logits = program.run("prefill", tokens, torch.tensor([0]))[0]
    rel_tol = 1e-4 if quant == "fp32" else 0.05
    generated = []
    for step in range(DECODE_STEPS):
        expected = reference(tokens)[-1]
        assert (logits[0] - expected).abs().max() <= rel_tol * expected.abs().max(), f"step {step}"
        assert int(logits.argmax()) == int(expected.argmax()), f"greedy token differs at step {step}"
        next_token = logits.argmax(-1).view(1, 1)
        generated.append(int(next_token))
        logits = program.run("decode_one_token", next_token, torch.tensor([tokens.shape[1]]))[0]
        tokens = torch.cat([tokens, next_token], dim=1)
    assert len(set(generated)) > 1, "a degenerate model would hide cache bugs"


@pytest.mark.parametrize("backend,quant", [("xnnpack", "fp32")])
def test_decode_without_prefill_sees_an_empty_cache(exported, backend: str, quant: str) -> None:
    """Negative control for the test above: the cache, not luck, carries the prompt into decode."""
    result = export_pair(exported, backend, quant)
    tokens = torch.randint(3, 384, (1, PROMPT_LEN + 1), generator=torch.Generator().manual_seed(2))
    warm = LoadedProgram(result.pte_path)
    warm.run("prefill", tokens[:, :-1], torch.tensor([0]))
    with_cache = warm.run("decode_one_token", tokens[:, -1:], torch.tensor([PROMPT_LEN]))[0]
    cold = LoadedProgram(result.pte_path).run("decode_one_token", tokens[:, -1:], torch.tensor([PROMPT_LEN]))[0]
    assert (with_cache - cold).abs().max() > 1e-2


@pytest.mark.parametrize("backend,quant", PAIRS)
def test_manifest_records_the_export(exported, backend: str, quant: str) -> None:
    result = export_pair(exported, backend, quant)
    m = json.loads(result.manifest_path.read_text())
    assert m["status"] == "ok"
    pte = result.pte_path.read_bytes()
    assert m["program"]["size_bytes"] == len(pte)
    import hashlib

    assert m["program"]["sha256"] == hashlib.sha256(pte).hexdigest()
    assert m["methods"]["decode_one_token"]["inputs"][0] == {"name": "tokens", "shape": [1, 1], "dtype": "int64"}
    assert m["methods"]["prefill"]["inputs"][0]["shape"][1] == "num_tokens"
    assert m["methods"]["prefill"]["outputs"][0]["shape"] == [1, 384]
    # forward is prefill's graph, lowered once and emitted under both names: identical outputs.
    assert m["methods"]["forward"]["lowered_once_with"] == "prefill" and m["methods"]["prefill"]["lowered_once_with"] is None
    assert m["validation"]["forward_kl"] <= 1e-12
    v = m["validation"]
    assert v["passed"] and not v["failures"] and v["methods"] == {"prompt": "prefill", "step": "decode_one_token",
                                                                   "forward": "checked against prefill"}
    assert v["scored_tokens"] == 256 and v["text"] == "the tiny model's training text (models/tiny.py)"
    assert v["top1_agreement"] >= v["tolerance"]["min_top1"] and v["kl_mean"] <= v["tolerance"]["max_kl"]
    if quant == "fp32":
        assert v["top1_agreement"] == 1.0 and v["perplexity"] == pytest.approx(v["baseline_perplexity"], rel=1e-5)
        # the eager model is the unquantized one: against it and against the baseline, the same numbers
        assert (v["kl_vs_unquantized"], v["top1_vs_unquantized"]) == (v["kl_mean"], v["top1_agreement"])
    else:  # what the export costs in all includes what quantizing cost the eager model
        assert v["kl_vs_unquantized"] > v["kl_mean"] and v["top1_vs_unquantized"] < 1.0
    assert v["quality"].startswith(f"perplexity {v['perplexity']:.2f} (eager ")
    assert f"against unquantized {v['baseline_dtype']}: KL {v['kl_vs_unquantized']:.2g}, top-1 " in v["quality"]
    assert set(m["timings_s"]) == {"load", "baseline", "quantize", "capture", "lower", "emit", "validate", "advise"}
    # lowering's seconds per captured method (forward is prefill's; a backend with no partitioner has no split) and
    # per pass, adding up to ExecuTorch's call, most of the stage
    lowering = m["lowering"]
    assert lowering["passes_s"] and set(lowering["methods"]) == ({"prefill", "decode_one_token"}
                                                                  if backend != "portable" else set())
    for name, t in lowering["methods"].items():
        assert t["to_edge_s"] > 0 and t["decompositions"] == 1 and t["preprocess_s"] > 0
        assert t["partitions"] == m["methods"][name]["delegated_partitions"]
    shares = sum(t["to_edge_s"] + t["partition_s"] + t["preprocess_s"] for t in lowering["methods"].values())
    assert shares + lowering["other_s"] == pytest.approx(lowering["total_s"], abs=0.05)
    assert 0.8 * m["timings_s"]["lower"] < lowering["total_s"] <= m["timings_s"]["lower"]
    assert m["config"]["backend"]["name"] == backend and m["config"]["quant"]["name"] == quant
    assert m["versions"]["executorch"] == metadata.version("executorch")
    if quant == "8da4w":
        assert m["quantization"]["linear"]["torchao_config"] == "Int8DynamicActivationIntxWeightConfig"
        assert m["quantization"]["lm_head"]["layers"] == {"lm_head": 32}
        assert m["quantization"]["untied_embeddings"]
    for name in ("tokenizer.json", "generation_config.json"):
        assert (result.pte_path.parent / name).exists()
    # The file is the typed manifest export() returned, field for field.
    assert Manifest.read(result.pte_path.parent) == result.manifest


def test_a_manifest_that_does_not_fit_is_refused_by_name(exported, tmp_path: Path) -> None:
    m = json.loads(export_pair(exported, "xnnpack", "fp32").manifest_path.read_text())
    del m["program"]["sha256"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match=r"not a manifest this version.*program.*sha256.*Re-export"):
        Manifest.read(tmp_path)


def test_a_manifest_written_by_0_1_is_still_read(exported, tmp_path: Path) -> None:
    """0.1 wrote validation's baseline as reference_*, its drift tolerance as max_ppl_increase, no version; before
    version 3 there were no components (every program held one decoder)."""
    result = export_pair(exported, "xnnpack", "fp32")
    m = json.loads(result.manifest_path.read_text())
    v = m["validation"]
    v["reference_perplexity"], v["reference_dtype"] = v.pop("baseline_perplexity"), v.pop("baseline_dtype")
    v["tolerance"]["max_ppl_increase"] = v["tolerance"].pop("max_ppl_drift")
    assert list(m.pop("components")) == ["decoder"]
    del m["version"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    assert Manifest.read(tmp_path) == result.manifest


def test_second_method_stores_no_second_copy_of_the_weights(exported) -> None:
    """XNNPACK keys weights by content across methods: adding prefill (and forward, prefill's plan renamed) adds
    graph bytes, no weight bytes."""
    both = exported("backend=xnnpack", "quant=fp32")  # the default methods: test_program_has_methods_and_constants'
    one = exported("backend=xnnpack", "quant=fp32", "export.methods=[decode]", "export.layout=split")
    s2, s1 = both.manifest.program.storage, one.manifest.program.storage
    # 7 linears per layer + the RoPE rotate_half matrix, each its own entry; the tied lm_head reads the
    # embedding's constant (export.tied_embedding=shared), so it has none.
    from models.tiny import DEFAULT_ARCH

    assert s1["named_data_entries"] == 7 * DEFAULT_ARCH["num_hidden_layers"] + 1
    for key in ("named_data_entries", "named_data_bytes", "constant_buffer_bytes"):
        assert s2[key] == s1[key], key
    growth = s2["total_bytes"] - s1["total_bytes"]
    assert 0 < growth < 0.15 * s1["named_data_bytes"], "the second method adds only its graph"


@pytest.mark.parametrize("backend,quant", PAIRS)
def test_storage_breakdown_agrees_with_a_full_deserialization(exported, backend: str, quant: str) -> None:
    """The manifest's breakdown reads only the program's flatbuffer (the whole file costs 565 MB of RSS on the
    134M preset); ExecuTorch's deserializer, which restores every segment, must count the same bytes."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    result = export_pair(exported, backend, quant)
    pte = deserialize_pte_binary(result.pte_path.read_bytes())
    named = pte.named_data
    storage = result.manifest.program.storage
    assert storage["total_bytes"] == result.pte_path.stat().st_size
    assert storage["constant_buffer_bytes"] == sum(len(b.storage) for b in pte.program.constant_buffer) > 0
    assert storage["named_data_bytes"] == (sum(len(b) for b in named.buffers) if named else 0)
    assert storage["named_data_entries"] == (len(named.pte_data) if named else 0)
    assert (storage["named_data_bytes"] > 0) == (backend == "xnnpack")


@pytest.mark.slow
def test_an_alias_is_written_as_executorch_plans_and_emits_it(tmp_path: Path) -> None:
    """Emit adds forward as prefill's execution plan renamed, skipping to_executorch's passes for it; ExecuTorch,
    given forward as its own copy of prefill's lowered graph (how emit worked before), writes the same bytes."""
    import copy

    from exporters.export import run_stages
    from exporters.stages.emit import backend_config, to_executorch
    from tests.helpers import compose_config

    lowered, _ = run_stages(compose_config("backend=xnnpack", "validate=false"), tmp_path, stop_after="lower")
    aliases = lowered.methods.aliases
    assert aliases == {"forward": "prefill"} and "forward" not in lowered.edge.methods
    edge = copy.deepcopy(lowered.edge)  # to_executorch consumes the programs it is given
    ours = to_executorch(lowered.edge, aliases).buffer

    source = edge.exported_program("prefill")
    shared = {id(t): t for t in (*source.state_dict.values(), *source.constants.values())}
    edge._edge_programs["forward"] = copy.deepcopy(source, shared)
    assert ours == edge.to_executorch(backend_config()).buffer


def test_the_xnnpack_passes_lowering_may_skip_are_the_ones_that_were_read() -> None:
    """Lowering skips an XNNPACK pass where a partition lacks the ops read from that pass's source; a pass of
    another ExecuTorch that is renamed or changed in any way fails here until its ops are read again."""
    import hashlib
    import inspect

    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    from exporters.program.internals import (_XNNPACK_PASS_CONDITIONS, _XNNPACK_PASS_OPS, _XNNPACK_SKIPPED_PASS_SOURCES,
                                             _xnnpack_pattern_pass_ops)

    passes = {p.__name__: p for p in XNNPACKPassManager(None).passes}  # type: ignore[arg-type]
    skippable = set(_XNNPACK_PASS_OPS) | set(_xnnpack_pattern_pass_ops()) | set(_XNNPACK_PASS_CONDITIONS)
    assert skippable == set(_XNNPACK_SKIPPED_PASS_SOURCES) and skippable <= set(passes)
    read = {name: hashlib.sha256(inspect.getsource(passes[name]).encode()).hexdigest()[:12] for name in skippable}
    assert read == _XNNPACK_SKIPPED_PASS_SOURCES


# Chains of (op, channels-last tag) after an input, as XNNPACK's channels-last pass leaves them: a decoder norm's mean
# between its two copies (kept), copies that undo each other or repeat their input's format (removed), and the same
# two copies between dequantize and quantize (removed).
COPY_CHAINS = {
    "norm": (("view_copy", False), ("_to_copy", True), ("mean", True), ("_to_copy", False)),
    "undone": (("view_copy", False), ("_to_copy", True), ("_to_copy", False)),
    "repeated": (("view_copy", False), ("_to_copy", False)),
    "quantized": (("dq", None), ("_to_copy", True), ("q", None), ("dq", None), ("_to_copy", False), ("q", None)),
}


@pytest.mark.parametrize("chain", COPY_CHAINS)
def test_the_copy_pass_runs_exactly_where_it_would_remove_a_copy(chain: str) -> None:
    """Lowering runs XNNPACK's RemoveRedundantCopyPass only where ``_redundant_copies`` finds a copy to remove: on each
    chain, that answer is whether the pass's own removal functions change the graph."""
    from executorch.backends.xnnpack._passes.remove_redundant_copy_pass import RemoveRedundantCopyPass
    from executorch.exir.dialects._ops import ops as exir_ops

    from exporters.program.internals import _redundant_copies

    ops = {"view_copy": exir_ops.edge.aten.view_copy.default, "_to_copy": exir_ops.edge.aten._to_copy.default,
           "mean": exir_ops.edge.aten.mean.dim,
           "q": exir_ops.edge.quantized_decomposed.quantize_per_tensor.default,
           "dq": exir_ops.edge.quantized_decomposed.dequantize_per_tensor.default}
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    for op, nhwc in COPY_CHAINS[chain]:
        node = graph.call_function(ops[op], (node,))
        if nhwc is not None:
            node.meta["XNN_NHWC_NODE"] = nhwc
    graph.output(node)
    found = _redundant_copies(graph)

    removal = RemoveRedundantCopyPass.__new__(RemoveRedundantCopyPass)  # its call() without the retrace
    before = len(graph.nodes)
    for node in [n for n in graph.nodes if n.target == ops["_to_copy"]]:
        if node.graph is graph and node in graph.nodes:  # not erased by an earlier removal
            (removal._try_remove_quantized_redundant_to_copy if node.args[0].target == ops["dq"]
             else removal._try_remove_regular_redundant_to_copy)(node, graph)
    assert found == (len(graph.nodes) < before) == (chain != "norm")


def test_the_cia_ops_collected_once_are_torchs_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within ``cia_ops_collected_once`` the operators torch.export may keep are torch's own set, collected once while
    the registry is unchanged (a copy each time), and anew when an operator is registered; torch's function after it."""
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils

    from exporters.program.internals import cia_ops_collected_once

    stock, collections = export_utils._collect_all_valid_cia_ops, []

    def counted() -> set:
        collections.append(1)
        return stock()

    monkeypatch.setattr(export_utils, "_collect_all_valid_cia_ops", counted)
    with cia_ops_collected_once():
        first = decomp_utils._collect_all_valid_cia_ops()
        again = export_utils._collect_all_valid_cia_ops()
        assert first == stock() and again == first and again is not first and len(collections) == 1
        library = torch.library.Library("llm_exporters_cia_test", "DEF")  # a namespace and an operator the set lacks
        library.define("twice(Tensor x) -> Tensor")
        library.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")
        grown = export_utils._collect_all_valid_cia_ops()
        assert grown == stock() and grown - first == {torch.ops.llm_exporters_cia_test.twice.default}
        assert len(collections) == 2
    assert export_utils._collect_all_valid_cia_ops is counted


def test_the_edge_passes_lowering_may_skip_are_the_ones_that_were_read() -> None:
    """Lowering skips an edge dialect pass where a method's graph lacks what was read from that pass's source; a pass
    of another ExecuTorch that is renamed or changed in any way fails here until it is read again."""
    import hashlib
    import inspect

    from exporters.program.internals import _EDGE_SKIPPED_PASS_SOURCES, _edge_pass_applies, _edge_pass_classes

    classes = _edge_pass_classes()
    assert set(_edge_pass_applies()) == set(classes) == set(_EDGE_SKIPPED_PASS_SOURCES)
    read = {name: hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:12] for name, cls in classes.items()}
    assert read == _EDGE_SKIPPED_PASS_SOURCES


@pytest.mark.extended  # about 2 minutes (the stock path is ExecuTorch's slow one): `pytest -m extended` before a release
def test_the_stock_path_writes_the_same_program_as_the_shortcuts(tmp_path: Path) -> None:
    """export.shortcuts=false takes the libraries' stock path everywhere exporters.program.internals patches them: torchao's
    own HQQ, its quant ops run op by op, each method decomposed three times and put through every edge dialect pass,
    ExecuTorch's multi-method to_backend copying every partition at once with all of XNNPACK's passes, emit tracing
    each delegate call by running its partition's graph, each packed weight held per method, forward lowered
    on its own instead of written as prefill's plan renamed. The program is the same bytes; afterwards the patched internals are ExecuTorch's and torchao's own."""
    import contextlib
    import importlib

    from exporters.export import run_stages
    from exporters.program.internals import delegate_calls_traced_from_their_outputs
    from exporters.stages.emit import to_executorch
    from tests.helpers import compose_config

    def program(shortcuts: bool) -> bytes:
        # One layer: every shortcut applies per method and per partition, not per layer; prefill and forward (the
        # one renamed from the other's plan), without decode: a third method is one more of the same.
        lowered, ctx = run_stages(compose_config("backend=xnnpack", "quant=8da4w_emb4w", "validate=false",
                                                 "model.arch.num_hidden_layers=1", "export.methods=[prefill,forward]",
                                                 f"export.shortcuts={str(shortcuts).lower()}"),
                                  tmp_path / str(shortcuts), stop_after="lower")
        assert ctx.plan.shortcuts == shortcuts and bool(lowered.methods.aliases) == shortcuts
        # ExecuTorch retraces each method three times for XNNPACK, the shortcuts once; they skip the transpose pass
        assert {t.decompositions for t in ctx.lowering.methods.values()} == {1 if shortcuts else 3}
        assert ("NormalizeTransposePass" in ctx.lowering.passes_s) != shortcuts
        with delegate_calls_traced_from_their_outputs() if shortcuts else contextlib.nullcontext():
            return to_executorch(lowered.edge, lowered.methods.aliases).buffer

    assert program(shortcuts=True) == program(shortcuts=False)
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    assert XNNPACKPassManager.transform.__name__ == "transform"
    from executorch.exir.program import _program

    assert _program._gen_edge_manager_for_partitioners.__module__ == _program.__name__
    from executorch.exir.passes import NormalizeTransposePass

    assert "__call__" not in NormalizeTransposePass.__dict__
    delegate = importlib.import_module("torch._higher_order_ops.executorch_call_delegate")
    assert delegate.call_delegate_cpu.__module__ == delegate.__name__
    assert not hasattr(XnnpackBackend, "copy_exported_program_for_preprocess") or \
        XnnpackBackend.copy_exported_program_for_preprocess.__qualname__.startswith("BackendDetails")
    import torch.export.exported_program as exported_program

    assert exported_program._collect_all_valid_cia_ops.__module__ == "torch._export.utils"
    op = torch.ops.torchao.dequantize_affine.default  # torchao's own body is the kernel again
    codes, scale = torch.tensor([[2, -4]], dtype=torch.int8), torch.tensor([[0.5]])
    assert op(codes, [1, 2], scale, None, torch.int8).tolist() == [[1.0, -2.0]]


@pytest.mark.slow
def test_lowering_leaves_no_graph_alive(tmp_path: Path) -> None:
    """Once lowering's result is dropped, its graphs are gone: nothing of ExecuTorch's keeps them (and with them the
    weights, delegates and packed weights) alive under validation (exporters.program.internals.lowering_forgets_graphs)."""
    import gc
    import weakref

    from exporters.export import run_stages
    from tests.helpers import compose_config

    lowered, _ = run_stages(compose_config("backend=xnnpack", "quant=8da4w", "validate=false", "export.methods=[decode]",
                                           "export.layout=split"), tmp_path,
                            stop_after="lower")
    graphs = [weakref.ref(lowered.edge.exported_program(m).graph_module) for m in lowered.edge.methods]
    assert graphs and all(g() is not None for g in graphs)
    del lowered
    gc.collect()
    assert [g() for g in graphs] == [None] * len(graphs)


def test_decode_only_program_validates_token_by_token(exported) -> None:
    result = exported("backend=xnnpack", "quant=fp32", "export.methods=[decode]", "export.layout=split")
    assert LoadedProgram(result.pte_path).method_names >= {"decode"}
    assert "prefill" not in result.manifest.methods
    v = result.manifest.validation
    assert v.passed and v.methods == {"prompt": "decode", "step": "decode", "forward": None}


@pytest.mark.slow
def test_failed_validation_leaves_no_finished_looking_program(tmp_path: Path) -> None:
    from exporters.export import export
    from exporters.errors import ValidationFailed
    from tests.helpers import compose_config

    cfg = compose_config("backend=portable", "quant.max_kl=0.0", "validation.max_tokens=16", "export.methods=[decode]",
                         "export.layout=split")
    with pytest.raises(ValidationFailed, match="does not match the eager model"):
        export(cfg, tmp_path)
    assert not (tmp_path / "model.pte").exists()
    assert (tmp_path / "model.rejected.pte").exists()
    assert not list(tmp_path.glob("*.unvalidated.pte")) and not list(tmp_path.glob(".*.tmp"))
    assert json.loads((tmp_path / "manifest.json").read_text())["status"] == "failed validation"


def test_failed_load_writes_no_program(tmp_path: Path) -> None:
    from exporters.export import export
    from models.errors import ModelError
    from tests.helpers import compose_config

    with pytest.raises(ModelError):
        export(compose_config("model=llama", f"model.checkpoint={tmp_path / 'missing'}"), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.pte"))


def test_xnnpack_pattern_ops_are_traced_once_per_executorch_version(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The ops of XNNPACK's pattern graphs (which passes a partition needs) are traced by the first export process
    and read back from the cache folder by the next ones: the same sets either way."""
    from exporters.program import internals

    monkeypatch.setenv("LLM_EXPORTERS_CACHE", str(tmp_path))
    internals._xnnpack_pattern_pass_ops.cache_clear()
    traced = internals._xnnpack_pattern_pass_ops()
    assert list(tmp_path.glob("xnnpack-pattern-ops-*.json"))
    internals._xnnpack_pattern_pass_ops.cache_clear()
    assert internals._xnnpack_pattern_pass_ops() == traced and "aten.bmm.default" in set().union(
        *traced["ConvertToSDPAPass"])
    internals._xnnpack_pattern_pass_ops.cache_clear()
