"""Every use of a private ExecuTorch or torchao internal, in one place, with the versions it was checked against.

Checked with the versions in ``exporters.program.versions.CHECKED`` (pyproject.toml pins them); with any other installed,
lowering takes the stock path (``exporters.program.versions.shortcuts_allowed``). When a pin moves, these are the lines to
re-read; each has a test that fails if the internal changes behaviour:

- :func:`read_program_header`: ExecuTorch has no public reader of a ``.pte``'s flatbuffer alone (its public
  ``deserialize_pte_binary`` copies every weight segment: docs/DESIGN.md 2c).
  Test: ``tests/test_export.py::test_storage_breakdown_agrees_with_a_full_deserialization``.
- :func:`read_data_file_header`: the same for a ``.ptd`` (FlatTensor): its public ``FlatTensorSerializer.deserialize``
  copies every weight; the header and ``_deserialize_to_flat_tensor`` read the table of named tensors alone.
  Test: ``tests/test_external_weights.py``.
- :func:`write_tensor_file` / :func:`read_tensor_file`: a ``.ptd`` of named tensors written and read with the
  FlatTensor serializer and its payload types (``executorch.exir._serialize.data_serializer``), as the named data
  store does for a program's weights: swappable adapters' files. Test: ``tests/test_swappable_adapters.py``.
- :func:`reserialize`: emit adds ``forward`` as ``prefill``'s execution plan renamed, then serializes the
  manager again; the manager keeps its serialized bytes in private fields.
  Test: ``tests/test_export.py::test_an_alias_is_written_as_executorch_plans_and_emits_it``.
- :func:`torchao_hqq_scale_only` / :func:`torchao_hqq_replaced`: torchao's HQQ scale-only solver, and the
  module-level name its intx weight tensors call it by, swapped for the row-blocked version in
  ``exporters.quant.hqq``. Test: ``tests/test_quant_backends.py::test_hqq_by_rows_is_torchaos_hqq_bit_for_bit``.
- :func:`xnnpack_keys_by_name`: XNNPACK's serializer names each weight it hands to the named data store by the
  sha256 of its bytes (``backends/xnnpack/operators/node_visitor.py``, ``get_serialized_buffer_index`` and
  ``get_quant_params``), so a program's delegates name its weights' contents and another checkpoint of the same
  shapes gives another ``.pte``. Within this block they are named by the tensor's fully qualified name instead
  (XNNPACK's own ``utils.get_tensor_name``), so a program with its weights in a ``.ptd`` is the same bytes
  whatever the weights. Test: ``tests/test_external_weights.py``.
- :func:`set_backend_options` / :func:`backend_options`: ExecuTorch's C++ ``executorch::runtime::set_option``
  (``runtime/backend/interface.h``), which no Python binding exposes, called through ``lib/libexecutorch.so``
  of the wheel (the library the Python runtime links): how our tools turn on XNNPACK's weight cache. It relies
  on the C++ layout of ``BackendOption`` (``runtime/backend/options.h``: a 64-byte key, then a
  ``std::variant<bool, int, std::array<char, 256>>``, 324 bytes under libstdc++) and on the mangled names; the
  option is read back after every write. Test: ``tests/test_runtime_options.py``.
- :func:`merge_data_files`: ExecuTorch 1.5.1's Python runtime loads a program with one data file (C++'s
  ``Module`` takes several), so a program whose adapters have their own ``.ptd`` is loaded here through one
  file holding the base's and the adapters' named tensors, written with ExecuTorch's own ``FlatTensorSerializer``
  (its ``serialize`` takes the private ``Cord``). Test: ``tests/test_lora.py`` (adapters in their own data files).
- :func:`xnnpack_preprocess_copies_one_at_a_time`: ExecuTorch's multi-method ``to_backend``
  (``exir/backend/backend_api.py``, ``lower_all_submodules_to_backend``) deep-copies every partition of every method
  before any is preprocessed (``BackendDetails.copy_exported_program_for_preprocess``), weights included: a whole
  second copy of the quantized model alive through XNNPACK's preprocessing (+2.1 GB on the 8B shape cut to 2 layers,
  +9 GB at 8B). Sharing the weights with those copies (as ExecuTorch's CUDA backend does in its low-memory mode) is
  not safe for XNNPACK: its preprocess writes into some of them (a mixed 4/8-bit program came out wrong). Within this
  block each partition is still deep-copied, but just before its own preprocess, and dropped after it: one
  partition's copy alive at a time; after its preprocess the copy's weights are released at once (their storage
  emptied), not left to the cycle collector. Test: ``tests/test_export.py::test_the_stock_path_writes_the_same_program_as_the_shortcuts``.
- :func:`xnnpack_passes_only_where_they_apply`: XNNPACK's ``XNNPACKPassManager.transform``
  (``backends/xnnpack/_passes/__init__.py``) runs its 17 passes on every partition, and each retraces the whole
  partition even when it changes nothing. Within this block a pass is skipped where the partition holds none of the
  ops it acts on (a table read from each pass's ``call``, or its pattern graphs' ops). Test: the same.
- :func:`edge_programs_decomposed_once`: ExecuTorch's ``to_edge_transform_and_lower`` (``exir/program/_program.py``,
  ``_gen_edge_manager_for_partitioners``) retraces every method three times with ``run_decompositions`` for a
  partitioner that checks the ops it keeps (XNNPACK's): to functionalize, with the kept ops, and with the whole table
  after renaming the accepted ones. Within this block its own steps run (the same private helpers of that module)
  without the first retrace (the second functionalizes too) and without the third where no op it would decompose is
  left: a third of SmolLM2's lowering. Test: ``tests/test_export.py::test_the_stock_path_writes_the_same_program_as_the_shortcuts``.
- :func:`edge_passes_only_where_they_apply`: ``to_edge``'s passes (``exir/program/_program.py``,
  ``_generate_edge_program``) each retrace the whole method even when they change nothing. Within this block five of
  them are skipped where the graph lacks what they act on (``_edge_pass_applies``, read from each pass's source,
  whose hash ``_EDGE_SKIPPED_PASS_SOURCES`` keeps). Test: ``tests/test_export.py`` (the same two tests as XNNPACK's).
- :func:`delegate_calls_traced_from_their_outputs`: ExecuTorch's fake kernel of ``executorch_call_delegate``
  (``torch/_higher_order_ops/executorch_call_delegate.py``) unlifts the partition's original program into a module
  and runs its whole graph on every retrace of a lowered method (emit's ``SpecPropPass`` and dim-order pass). Within
  this block the outputs are made from the partition's output metadata where it describes them, the stock kernel
  running otherwise. Test: ``tests/test_export.py::test_the_stock_path_writes_the_same_program_as_the_shortcuts``.
- :func:`named_data_stored_once`: XNNPACK's preprocess (``backends/xnnpack/operators/node_visitor.py``) hands each
  packed weight to a per-partition ``NamedDataStore`` as a fresh ``bytes``, so the same weight lowered for ``prefill``
  and for ``decode_one_token`` is held twice (under one key) until emit merges the stores: a second copy of the
  program's weights through the rest of lowering (4.2 GB at 8B). Within this block a key already stored gives its
  bytes object to the next store, and the equal copy is dropped at once.
  Test: ``tests/test_export.py::test_the_stock_path_writes_the_same_program_as_the_shortcuts``.
- :func:`lowering_forgets_graphs`: two things in ExecuTorch keep every lowered graph alive after lowering, and
  through each graph module its program: the eager weights, every delegate and its packed weights (5 GB at 8B,
  under validation's peak). ``exir/backend/utils.py``'s ``is_same_node`` is an unbounded ``lru_cache`` keyed by the
  graphs' nodes, and XNNPACK's partitioner configs (``backends/xnnpack/partition/config/*.py``) keep a module-level
  ``WhyNoPartition`` that remembers the last node it refused. On leaving the block the cache is cleared and each
  such reporter forgets its node. Test: ``tests/test_export.py::test_lowering_leaves_no_graph_alive``.
- :func:`torchao_quant_ops_shape_only`: torchao registers ``quantize_affine``, ``dequantize_affine`` and
  ``choose_qparams_affine`` as CompositeImplicitAutograd ops (``quantization/quant_primitives.py``, ``quant_lib``)
  with no fake kernel, so every ExecuTorch pass, verifier and decomposition that propagates fake tensors re-runs their
  Python bodies op by op (about 40% of lowering's samples, docs/DESIGN.md 2c). A Meta or fake kernel cannot be
  registered beside a CompositeImplicitAutograd one, so within the block the kernel itself is replaced by one that
  returns empty tensors of the body's shapes and dtypes when its input is a fake tensor and nothing is being traced,
  and runs torchao's body (kept by torchao in inductor's decomposition table) otherwise; the body is registered
  again on the way out. Programs are the same bytes.
  Test: ``tests/test_export.py::test_the_stock_path_writes_the_same_program_as_the_shortcuts``.
- :func:`cia_ops_collected_once`: torch.export's ``_collect_all_valid_cia_ops`` (``torch/_export/utils.py``) walks every
  operator namespace, and for each one that is not ``aten`` asks the C++ dispatcher for every CompositeImplicitAutograd
  operator again: about 0.15 s a call, seven calls in the tiny model's export, twenty in Gemma 4's of every modality
  (each ``run_decompositions`` and each decomposition table). Within this block the set is collected once and given
  again while the operator registry is unchanged (the same namespaces, operators and CompositeImplicitAutograd
  registrations). Test: ``tests/test_export.py::test_the_cia_ops_collected_once_are_torchs_own``.
- :func:`pt2e_annotation_key`: the node-meta key a PT2E quantizer writes its annotations under (torchao's
  ``quantizer.quantizer.Q_ANNOTATION_KEY``, not exported by ``torchao.quantization.pt2e.quantizer``);
  ``exporters.quant.pt2e.LinearsOnly`` removes the annotations of every node but the model's linear layers.
  Test: ``tests/test_pt2e.py`` (the quantized linears of a converted graph are exactly the model's).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from exporters.output.files import write_atomically
from exporters.program.versions import CHECKED as CHECKED_WITH

if TYPE_CHECKING:
    import torch


def read_program_header(path: Path) -> Any:
    """The program flatbuffer of a ``.pte`` (graphs, tables, segment sizes), without reading its segments."""
    from executorch.exir._serialize._program import _flatbuffer_to_program, _get_extended_header

    with open(path, "rb") as f:
        header = _get_extended_header(f.read(64))
        f.seek(0)
        # Without an extended header there are no segments: the flatbuffer is the whole file.
        return _flatbuffer_to_program(f.read(header.program_size if header is not None else -1))


def read_data_file_header(path: Path) -> Any:
    """The table of a ``.ptd`` (named tensors, segment sizes), without reading its segments."""
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, _deserialize_to_flat_tensor

    with open(path, "rb") as f:
        start = f.read(8 + FlatTensorHeader.EXPECTED_LENGTH)
        header = FlatTensorHeader.from_bytes(start[8:])
        if not header.is_valid():
            raise ValueError(f"{path} is not an ExecuTorch data file (.ptd): no FlatTensor header")
        f.seek(0)
        return _deserialize_to_flat_tensor(f.read(header.flatbuffer_offset + header.flatbuffer_size))


def merge_data_files(paths: list[Path], out: Path) -> None:
    """One ``.ptd`` with every named tensor of ``paths`` (their names are disjoint: each weight has one owner)."""
    from executorch.exir._serialize._cord import Cord
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    serializer, buffers, named = FlatTensorSerializer(), [], {}
    for path in paths:
        payload = serializer.deserialize(Cord(path.read_bytes()))
        for key, entry in payload.named_data.items():
            assert key not in named, f"{key} is in two data files"
            # Deserializing forgets alignment; the serializer aligns every segment to 128 bytes anyway.
            named[key] = DataEntry(len(buffers) + entry.buffer_index, entry.alignment, entry.tensor_layout)
        buffers.extend(payload.buffers)
    with open(out, "wb") as fh:
        serializer.serialize(DataPayload(buffers=buffers, named_data=named)).write_to_file(fh)


def tensor_data_bytes(manager: Any) -> int | None:
    """The bytes of the data files an ``ExecutorchProgramManager`` will write (its private ``_tensor_data``, one
    Cord per file); None where another ExecuTorch keeps them elsewhere (the caller then names no size)."""
    cords = getattr(manager, "_tensor_data", None)
    return sum(len(c) for c in cords.values()) if isinstance(cords, dict) else None


def reserialize(manager: Any, config: Any) -> None:
    """Serialize an ``ExecutorchProgramManager`` again after its ``executorch_program`` was edited.

    The manager serializes once, in its constructor, into private fields that ``write_to_file`` and ``buffer``
    read. The serializer copies the execution plans and shares the data.
    """
    from executorch.exir._serialize._serialize import serialize_for_executorch

    manager._pte_data, manager._tensor_data = serialize_for_executorch(
        manager._emitter_output, config, manager._data_serializer, manager._named_data)


def torchao_hqq_scale_only() -> Callable[..., Any]:
    """torchao's ``_choose_qparams_and_quantize_scale_only_hqq`` (whole-matrix HQQ, scale only)."""
    from torchao.quantization.quant_primitives import _choose_qparams_and_quantize_scale_only_hqq

    return _choose_qparams_and_quantize_scale_only_hqq


@contextlib.contextmanager
def torchao_hqq_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """Within this block, torchao's intx weight tensors choose HQQ scales with ``replacement``."""
    from torchao.quantization.quantize_.workflows.intx import intx_unpacked_to_int8_tensor as intx

    original = intx._choose_qparams_and_quantize_scale_only_hqq
    intx._choose_qparams_and_quantize_scale_only_hqq = replacement
    try:
        yield
    finally:
        intx._choose_qparams_and_quantize_scale_only_hqq = original


@contextlib.contextmanager
def xnnpack_preprocess_copies_one_at_a_time() -> Iterator[None]:
    """Within this block, XNNPACK's preprocess gets its own deep copy of each partition made just before it runs and
    dropped after, instead of copies of every partition of every method made up front."""
    import copy

    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    preprocess = XnnpackBackend.preprocess  # a staticmethod: the plain function

    def preprocess_a_copy(edge_program: Any, compile_specs: Any) -> Any:
        copied = copy.deepcopy(edge_program)
        try:
            return preprocess(copied, compile_specs)
        finally:
            release_weights_of_a_copy(copied, edge_program)

    XnnpackBackend.copy_exported_program_for_preprocess = classmethod(  # type: ignore[assignment]
        lambda cls, edge_program, compile_specs: edge_program)
    XnnpackBackend.preprocess = staticmethod(preprocess_a_copy)  # type: ignore[assignment]
    try:
        yield
    finally:
        XnnpackBackend.preprocess = staticmethod(preprocess)  # type: ignore[assignment]
        del XnnpackBackend.copy_exported_program_for_preprocess


def release_weights_of_a_copy(copied: Any, original: Any) -> None:
    """Give back the memory of the weights of ``copied``, a deep copy of ``original`` no one else holds, now rather
    than when the cycle collector next finds its graph (a graph is a web of cycles). A full ``gc.collect()`` per
    partition did the same at half a second each: 50 of SmolLM2's 200 s of lowering (63 partitions). A tensor
    that still shares memory with the original is left alone; anything that read a released one afterwards would
    fail loudly (its storage is empty), and nothing does: preprocess hands the weights on as ``bytes`` copies."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor

    def real_tensors(program: Any) -> list[torch.Tensor]:
        return [t for t in [*program.state_dict.values(), *program.constants.values()]
                if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type == "cpu"]

    kept = {t.untyped_storage().data_ptr() for t in real_tensors(original)}
    for tensor in real_tensors(copied):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in kept and storage.resizable():
            storage.resize_(0)


# XNNPACK preprocess passes that act only on graphs holding one of these ops (``node.target.__name__``), read from
# each pass's ``call`` in executorch 1.5.1 (``backends/xnnpack/_passes``, ``backends/transforms``).
_XNNPACK_PASS_OPS: dict[str, frozenset[str]] = {
    "FuseBatchNormPass": frozenset({"aten.native_batch_norm.default", "aten._native_batch_norm_legit_no_training.default"}),
    "DecomposeBatchNorm": frozenset({"aten.native_batch_norm.default",
                                     "aten._native_batch_norm_legit_no_training.default"}),
    "FuseActivationPass": frozenset({"aten.relu.default", "aten.hardtanh.default"}),
    "DecomposeConcatenate": frozenset({"aten.cat.default"}),
    "RemoveGetItemPass": frozenset({"aten.max_pool2d_with_indices.default", "aten.max.dim"}),
    "InsertPadQDQPass": frozenset({"aten.constant_pad_nd.default"}),
    "Conv1dUnsqueezePass": frozenset({"aten.convolution.default"}),
    "PReLUReshapePass": frozenset({"aten._prelu_kernel.default"}),
    "DimOrderOpsRevertPass": frozenset({"dim_order_ops._to_dim_order_copy.default",  # MemoryFormatOpsMap's keys
                                        "dim_order_ops._empty_dim_order.default",
                                        "dim_order_ops._clone_dim_order.default"}),
}

# The sha256 (first 12 hex digits) of each skippable pass's class source as read for the tables above: a pass that
# changes in another ExecuTorch fails tests/test_export.py until it is read again.
_XNNPACK_SKIPPED_PASS_SOURCES: dict[str, str] = {
    "Conv1dUnsqueezePass": "6e235a5ac754", "ConvertToSDPAPass": "d23a04af509e",
    "ConvertToUpsampleBilinear2d": "711c5e3e00df", "DecomposeBatchNorm": "aa0abaea1b71",
    "DecomposeConcatenate": "03f83199646f", "FuseActivationPass": "751d5edc43de", "FuseBatchNormPass": "d20f5c6a6f37",
    "InsertPadQDQPass": "3b29387c0a22", "PReLUReshapePass": "063a4ac4abd8", "RemoveGetItemPass": "c58434b5a108",
    "DimOrderOpsRevertPass": "04efcf31f4ef", "RemoveRedundantCopyPass": "61192c6844c1",
    "PropagateCustomMetaPass": "2605f4cbed81", "ConstPropPass": "e157eae24538",
}


def _custom_meta_to_propagate(graph: Any) -> bool:
    """PropagateCustomMetaPass copies ``meta["custom"]`` from a node to the quantize or dequantize node it feeds
    (XNNPACK's own ``is_quant``/``is_dequant``), then retraces."""
    import torch
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant

    return any((is_quant(n) or is_dequant(n)) and n.args and isinstance(n.args[0], torch.fx.Node)
               and "custom" in n.args[0].meta for n in graph.nodes)


def _constants_to_fold(graph: Any) -> bool:
    """ConstPropPass folds an op whose arguments are all constants: literals and tensors read with ``get_attr``,
    never a placeholder's traced value. Counted here wherever a call takes no input but ``get_attr`` nodes (a
    superset: the pass leaves per-tensor and per-channel quantize and dequantize alone)."""
    return any(n.op == "call_function" and all(i.op == "get_attr" for i in n.all_input_nodes) for n in graph.nodes)


def _redundant_copies(graph: Any) -> bool:
    """RemoveRedundantCopyPass removes a memory-format copy (``_to_copy``) that meets its input's format again: one
    whose input is a copy the other way with no other user, or is already in the copy's format; in a quantized graph
    the same through a dequantize -> copy -> quantize chain. On a decoder's partitions the copies it finds are the
    channels-last pair around each norm's mean, which it keeps: its retrace then changed nothing (0 of 130 partitions
    of tiny, Whisper and Gemma 4 programs), about 5% of lowering (10.9 of SmolLM2's 205.7 s). The conditions below
    are its own, read from ``_try_remove_regular_redundant_to_copy`` and ``_try_remove_quantized_redundant_to_copy``."""
    from executorch.backends.xnnpack._passes.channels_last_tagged_reshape_pass import \
        ChannelsLastTaggedReshapePass as Tagged
    from executorch.backends.xnnpack.utils.quant_utils import is_dequant, is_quant
    from executorch.exir.dialects._ops import ops as exir_ops

    copy_op = exir_ops.edge.aten._to_copy.default

    def same_format(a: Any, b: Any) -> bool:
        return (Tagged.is_nhwc_node(a) and Tagged.is_nhwc_node(b)) or (Tagged.is_nchw_node(a) and Tagged.is_nchw_node(b))

    def opposite_copy(before: Any, node: Any) -> bool:
        return (before.target == copy_op and Tagged.is_nchw_node(before) != Tagged.is_nchw_node(node)
                and len(before.users) == 1)

    def quantized_removable(node: Any) -> bool:
        quantize, dequantize = next(iter(node.users)) if len(node.users) == 1 else None, node.args[0]
        if quantize is None or not is_quant(quantize) or len(dequantize.all_input_nodes) != 1:
            return False
        prev_quantize = dequantize.args[0]
        if not is_quant(prev_quantize) or len(prev_quantize.all_input_nodes) != 1:
            return False
        before = prev_quantize.args[0]
        if opposite_copy(before, node):
            return is_dequant(before.args[0]) and len(before.args[0].all_input_nodes) == 1
        return same_format(before, node)

    for node in graph.nodes:
        if not node.all_input_nodes or node.target != copy_op:
            continue
        if quantized_removable(node) if is_dequant(node.args[0]) else (
                opposite_copy(node.args[0], node) or same_format(node.args[0], node)):
            return True
    return False


# XNNPACK preprocess passes that act only where these hold of the partition's graph (read from each pass's ``call``
# and ``call_operator`` in executorch 1.5.1).
_XNNPACK_PASS_CONDITIONS: dict[str, Callable[[Any], bool]] = {
    "PropagateCustomMetaPass": _custom_meta_to_propagate,
    "ConstPropPass": _constants_to_fold,
    "RemoveRedundantCopyPass": _redundant_copies,
}


def _target_names(graph: Any) -> set[str]:
    return {getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"}


@functools.cache
def _xnnpack_pattern_pass_ops() -> dict[str, list[frozenset[str]]]:
    """The two XNNPACK passes that rewrite subgraphs matching pattern graphs: each pattern's ops. A pattern
    matches only where every one of its ops is in the graph (``SubgraphMatcher`` compares targets).

    Tracing the pattern graphs takes seconds (3-5 s here), which every export process paid once: the ops are kept in
    the cache folder per ExecuTorch version (the patterns are its code) and read back by later processes."""
    import json
    from importlib import metadata

    # models.gguf reads the model families and, through them, transformers: loaded when the pattern ops are traced.
    from models.gguf import llm_exporters_cache

    path = llm_exporters_cache() / f"xnnpack-pattern-ops-{metadata.version('executorch')}.json"
    try:
        return {name: [frozenset(ops) for ops in patterns] for name, patterns in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        pass
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    found = {"ConvertToUpsampleBilinear2d": [frozenset(_target_names(g.graph)) for g in bilinear_2d.get_graphs()],
             "ConvertToSDPAPass": [frozenset(_target_names(g.graph)) for g in sdpa.get_graphs()]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({k: [sorted(ops) for ops in v] for k, v in found.items()}).encode())
    except OSError:  # a read-only cache folder: traced again next time
        pass
    return found


@contextlib.contextmanager
def xnnpack_passes_only_where_they_apply() -> Iterator[None]:
    """Within this block, XNNPACK's preprocess skips each of its passes whose ops are not in the partition's graph.

    ``XNNPACKPassManager.transform`` runs all 17 passes on every partition, and each ends by retracing the whole
    partition through fake tensors (``ExportPass.call``) even when it changed nothing: about 2.5 s per pass over
    SmolLM2's 63 partitions, for batch norm, convolution, PReLU, pad, max-pool, ReLU, concatenation, dim-order,
    copy, bilinear upsampling and SDPA rewrites on decoder layers that hold none of them. A pass is skipped only when the graph
    as it stands before that pass lacks every op the pass acts on (``_XNNPACK_PASS_OPS``), or, for the two
    pattern passes, lacks an op of each of their patterns, or, for three, where a condition read from the pass
    does not hold (``_XNNPACK_PASS_CONDITIONS``); the passes that always apply run as before (on SmolLM2's
    layers: removing clones, converting to linear, quantization metadata, channels-last tagging)."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.backends.xnnpack._passes.xnnpack_pass import XNNPACKPass
    from executorch.exir.pass_base import ExportPass
    from executorch.exir.program._program import _transform

    transform = XNNPACKPassManager.transform

    def applies(pass_: type, graph: Any) -> bool:
        name = pass_.__name__
        if name in _XNNPACK_PASS_CONDITIONS:
            return _XNNPACK_PASS_CONDITIONS[name](graph)
        if name in _XNNPACK_PASS_OPS:
            return bool(_XNNPACK_PASS_OPS[name] & _target_names(graph))
        patterns = _xnnpack_pattern_pass_ops()  # traced once, on the first XNNPACK partition
        if name not in patterns:
            return True
        present = _target_names(graph)
        return any(ops <= present for ops in patterns[name])

    def transform_where_they_apply(self: Any) -> Any:
        ep = self.exported_program
        for pass_ in self.passes:
            if not applies(pass_, ep.graph):
                continue
            if issubclass(pass_, XNNPACKPass):
                ep = _transform(ep, pass_(ep))
            elif issubclass(pass_, ExportPass):
                ep = _transform(ep, pass_())
            else:  # what XNNPACKPassManager.transform says of anything else
                raise RuntimeError(f"Expecting ExportPass or ExportPass(), but got pass: {pass_} with type: {type(pass_)}")
        return ep

    XNNPACKPassManager.transform = transform_where_they_apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        XNNPACKPassManager.transform = transform  # type: ignore[method-assign]


def _has_decomposable_op(program: Any, table: dict[Any, Any]) -> bool:
    """Whether a node of ``program`` calls an op ``table`` decomposes, other than ``aten.sym_size.int``: a
    CompositeImplicitAutograd op whose kernel reads a tensor's size, which tracing records as ``sym_size.int`` again."""
    import torch

    fixed_points = {torch.ops.aten.sym_size.int}
    return any(n.op == "call_function" and n.target in table and n.target not in fixed_points
               for n in program.graph.nodes)


@contextlib.contextmanager
def edge_programs_decomposed_once() -> Iterator[None]:
    """Within this block, ExecuTorch's ``to_edge_transform_and_lower`` decomposes each method once where its
    ``_gen_edge_manager_for_partitioners`` retraces it three times for a partitioner that checks each op it keeps
    (XNNPACK's): ``run_decompositions({})`` to functionalize, then with the backend's ops kept, then, after the
    kept ops the backend accepts are renamed out of reach, with the whole default table so that the refused ones
    decompose. The first is not needed (the second functionalizes as well), and the third changes nothing when no
    op the table decomposes is left; each retrace of SmolLM2's graph took 7-13 s. Any other case (a method with no
    partitioner, one that keeps ops without checking them, an ETRecord asked for) takes the stock function."""
    from collections import defaultdict

    from executorch.exir.program import _program as stock

    original = stock._gen_edge_manager_for_partitioners

    def decomposed_once(partitioner: dict[str, list[Any]], aten_programs: dict[str, Any], config: Any,
                        constant_methods: dict[str, Any] | None, generate_etrecord: bool | None = False) -> Any:
        if generate_etrecord or any(not partitioner.get(name) or any(
                stock._can_skip_using_EDGE_DO_NOT_DECOMP(p, program) for p in partitioner[name])
                for name, program in aten_programs.items()):
            return original(partitioner, aten_programs, config, constant_methods, generate_etrecord)
        kept_by_program: dict[str, set[Any]] = defaultdict(set)
        edge_programs = {}
        for name, program in aten_programs.items():
            program = stock._apply_pre_decomposition_transforms(program, partitioner[name])
            for p in partitioner[name]:  # the stock EDGE_DO_NOT_DECOMP path, without its repeats
                table = stock._default_decomposition_table()
                for op in stock._remove_invalid_ops_for_not_decompose(p.ops_to_not_decompose(program)[0]):
                    table.pop(op, None)
                program = program.run_decompositions(table)
                kept_by_program[name].update(stock._replace_aten_ops_with_transformed_ops(name, program, {name: [p]})
                                             or [])
                table = stock._default_decomposition_table()
                if _has_decomposable_op(program, table):
                    program = program.run_decompositions(table)
                stock._restore_transformed_ops_to_aten_ops(program)
            edge_programs[name] = stock._generate_edge_program(config, program,
                                                               preserve_ops=list(kept_by_program[name]))
        kept = list(set().union(*kept_by_program.values()))
        config._core_aten_ops_exception_list = list(set(config._core_aten_ops_exception_list) | set(kept))
        return stock.EdgeProgramManager(edge_programs, constant_methods, config, kept)

    stock._gen_edge_manager_for_partitioners = decomposed_once
    try:
        yield
    finally:
        stock._gen_edge_manager_for_partitioners = original


def _calls(graph: Any) -> list[Any]:
    return [n for n in graph.nodes if n.op == "call_function"]


def _tensor_args(node: Any) -> list[tuple[Any, Any]]:
    """(schema argument, value) of each argument of ``node`` that its op's schema types as one Tensor, as
    ExecuTorch's ``map_args`` pairs them."""
    import torch

    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    found = []
    for i, arg in enumerate(schema.arguments):
        if not isinstance(arg.type, torch.TensorType):
            continue
        if arg.name in node.kwargs:
            found.append((arg, node.kwargs[arg.name]))
        elif not arg.kwarg_only and i < len(node.args):
            found.append((arg, node.args[i]))
    return found


def _traced_value(node: Any, graph_module: Any) -> Any:
    """What an argument node holds while a pass retraces: its fake value, or the constant it reads."""
    if node.op == "get_attr":
        return getattr(graph_module, node.target, None)
    return node.meta.get("val")


def _sym_to_tensor_applies(graph_module: Any) -> bool:
    """SymToTensorPass rewrites a SymInt, SymFloat or SymBool given where the schema takes a Tensor."""
    import torch

    syms = (torch.SymInt, torch.SymFloat, torch.SymBool)
    return any(isinstance(value, torch.fx.Node) and isinstance(value.meta.get("val"), syms)
               for node in _calls(graph_module.graph) for _, value in _tensor_args(node))


def _mixed_types_apply(graph_module: Any) -> bool:
    """RemoveMixedTypeOperators casts an argument of add, mul, sub, div or minimum whose dtype is not the one the
    operands promote to. Where every operand of those ops is a tensor of one dtype (floating, for div) the
    promotion is that dtype and nothing is cast; anything else counts as applying."""
    import torch

    ops = {torch.ops.aten.add.Tensor, torch.ops.aten.mul.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.div.Tensor,
           torch.ops.aten.div.Tensor_mode, torch.ops.aten.minimum.default}
    for node in _calls(graph_module.graph):
        if node.target not in ops or len(node.args) <= 1:
            continue
        values = [_traced_value(a, graph_module) if isinstance(a, torch.fx.Node) else a for a in node.args]
        if not all(isinstance(v, torch.Tensor) for v in values) or len({v.dtype for v in values}) != 1:
            return True
        if node.target in (torch.ops.aten.div.Tensor, torch.ops.aten.div.Tensor_mode) and \
                not values[0].dtype.is_floating_point:
            return True
    return False


def _edge_pass_applies() -> dict[str, Callable[[Any], bool]]:
    """The edge dialect passes of ``to_edge`` that may be skipped, each with what it acts on (read from its
    ``call_operator`` in executorch 1.5.1, ``exir/passes``): a pass applies to a graph where this is true."""
    import torch
    from executorch.exir.passes.dim_order_ops_registry import DimOrderOpsMap

    def calling(match: Callable[[Any], bool]) -> Callable[[Any], bool]:
        return lambda gm: any(match(n.target) for n in _calls(gm.graph))

    return {
        "NormalizeTransposePass": calling(lambda t: t == torch.ops.aten.t.default),
        "ReplaceBrokenOpsWithFunctionalOpsPass": calling(lambda t: bool(getattr(t, "is_view", False))),
        "SymToTensorPass": _sym_to_tensor_applies,
        "RemoveMixedTypeOperators": _mixed_types_apply,
        "MemoryFormatOpsPass": calling(lambda t: t in DimOrderOpsMap),
    }


# The sha256 (first 12 hex digits) of each skippable edge pass's class source as read for the table above.
_EDGE_SKIPPED_PASS_SOURCES: dict[str, str] = {
    "NormalizeTransposePass": "9eda784569a1", "ReplaceBrokenOpsWithFunctionalOpsPass": "cd77e91fb55d",
    "SymToTensorPass": "4b4f5a945e26", "RemoveMixedTypeOperators": "e6f150761859", "MemoryFormatOpsPass": "38438c41e128",
}


def _edge_pass_classes() -> dict[str, type]:
    from executorch.exir.passes import (MemoryFormatOpsPass, NormalizeTransposePass,
                                        ReplaceBrokenOpsWithFunctionalOpsPass, SymToTensorPass)
    from executorch.exir.passes.remove_mixed_type_operators import RemoveMixedTypeOperators

    return {cls.__name__: cls for cls in (NormalizeTransposePass, ReplaceBrokenOpsWithFunctionalOpsPass,
                                          SymToTensorPass, RemoveMixedTypeOperators, MemoryFormatOpsPass)}


@contextlib.contextmanager
def edge_passes_only_where_they_apply() -> Iterator[None]:
    """Within this block, five of the edge dialect's passes are skipped on a graph that holds nothing they act on.

    ``to_edge`` runs its passes on every method (``exir/program/_program.py``, ``_generate_edge_program``), and each
    retraces the whole method through fake tensors even when it changes nothing: on SmolLM2's decoder, transposes
    written ``t``, view ops left after the view-copy pass, SymInts where a Tensor is taken, operands of mixed dtypes
    and ops taking a memory format are absent, yet each pass took as long as one that rewrites the graph. A pass is
    skipped only where the graph as it stands before that pass lacks what the pass acts on (``_edge_pass_applies``)."""
    from torch.fx.passes.infra.pass_base import PassResult

    applies, classes = _edge_pass_applies(), _edge_pass_classes()
    originals = {name: cls.__dict__.get("__call__") for name, cls in classes.items()}

    def only_where_it_applies(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def skipping(self: Any, graph_module: Any) -> Any:
            if not applies[name](graph_module):
                return PassResult(graph_module, False)
            return call(self, graph_module)
        return skipping

    for name, cls in classes.items():
        cls.__call__ = only_where_it_applies(name, cls.__call__)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, cls in classes.items():
            if originals[name] is None:
                del cls.__call__
            else:
                cls.__call__ = originals[name]  # type: ignore[method-assign]


def _delegate_outputs(lowered_module: Any, args: tuple[Any, ...]) -> Any:
    """The outputs of a delegate call on fake tensors, made from the lowered partition's own output metadata: each
    dimension a number, or a size of an input where the partition's graph has that input's symbol. None where that
    does not describe them (an output size computed from symbols, a strided output, anything not a tensor)."""
    import sympy
    import torch
    import torch.utils._pytree as pytree
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.export.graph_signature import OutputKind

    program = lowered_module.original_module
    inputs = [a for a in pytree.tree_leaves(args)]
    if not inputs or not all(isinstance(a, FakeTensor) for a in inputs):
        return None
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = [placeholders[name].meta.get("val") for name in program.graph_signature.user_inputs]
    if len(user_inputs) != len(inputs):
        return None
    sizes: dict[Any, Any] = {}
    for traced, given in zip(user_inputs, inputs):
        if not isinstance(traced, torch.Tensor) or traced.dim() != given.dim():
            return None
        for dim, size in zip(traced.shape, given.shape):
            if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                sizes[dim.node.expr] = size
    output = next(n for n in program.graph.nodes if n.op == "output")
    values = [node.meta.get("val") for node, spec in zip(output.args[0], program.graph_signature.output_specs)
              if spec.kind == OutputKind.USER_OUTPUT]
    outputs = []
    for value in values:
        if not isinstance(value, torch.Tensor) or not value.is_contiguous():
            return None
        shape = []
        for dim in value.shape:
            if isinstance(dim, int):
                shape.append(dim)
            elif isinstance(dim.node.expr, sympy.Symbol) and dim.node.expr in sizes:
                shape.append(sizes[dim.node.expr])
            else:
                return None
        outputs.append(torch.empty(shape, dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad))
    if not all(isinstance(o, FakeTensor) for o in outputs):
        return None
    return pytree.tree_unflatten(outputs, program.call_spec.out_spec)


@contextlib.contextmanager
def delegate_calls_traced_from_their_outputs() -> Iterator[None]:
    """Within this block, a delegate call traced on fake tensors takes its outputs' shapes from the lowered
    partition's output metadata (``_delegate_outputs``), where ExecuTorch's fake kernel
    (``torch/_higher_order_ops/executorch_call_delegate.py``, ``call_delegate_cpu``) unlifts the partition's
    original program into a module again and runs its whole graph, on every retrace of a lowered method: emit's
    spec propagation and dim-order passes, 72% of emit's samples on SmolLM2. Where the metadata does not describe
    the outputs, the stock kernel runs."""
    import importlib

    hop = importlib.import_module("torch._higher_order_ops.executorch_call_delegate")  # the module: the package
    original = hop.call_delegate_cpu  # exports its operator under the same name

    def from_outputs(lowered_module: Any, *args: Any) -> Any:
        outputs = _delegate_outputs(lowered_module, args)
        return original(lowered_module, *args) if outputs is None else outputs

    hop.call_delegate_cpu = from_outputs
    try:
        yield
    finally:
        hop.call_delegate_cpu = original


@contextlib.contextmanager
def lowering_forgets_graphs() -> Iterator[None]:
    """On leaving this block, nothing of ExecuTorch's keeps a lowered graph (and its whole program) alive: the
    ``is_same_node`` cache is cleared and the ``WhyNoPartition`` reporters forget the last node they refused."""
    import sys

    try:
        yield
    finally:
        from executorch.exir.backend.utils import WhyNoPartition, is_same_node

        is_same_node.cache_clear()
        for name, module in list(sys.modules.items()):
            if name.startswith("executorch.") and module is not None:
                for value in list(vars(module).values()):
                    if isinstance(value, WhyNoPartition):
                        value.node = None


@contextlib.contextmanager
def named_data_stored_once() -> Iterator[None]:
    """Within this block, equal named data added under one key to several stores is one ``bytes`` object."""
    from executorch.exir._serialize._named_data_store import NamedDataStore

    kept: dict[str, bytes] = {}
    add = NamedDataStore.add_named_data

    def add_once(self: Any, key: str, data: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(data, bytes):
            first = kept.setdefault(key, data)
            data = first if first is not data and first == data else data
        add(self, key, data, *args, **kwargs)

    NamedDataStore.add_named_data = add_once  # type: ignore[method-assign]
    try:
        yield
    finally:
        NamedDataStore.add_named_data = add  # type: ignore[method-assign]


def _fake_quantize_affine(input: Any, block_size: Any, scale: Any, zero_point: Any, output_dtype: Any,
                          quant_min: Any = None, quant_max: Any = None) -> Any:
    import torch
    from torchao.quantization import quant_primitives as qp

    qp._get_and_check_qmin_qmax(output_dtype, quant_min, quant_max)
    qp._get_reduction_params(block_size, input.size())  # the body's own shape checks
    return torch.empty_like(input, dtype=torch.uint8 if output_dtype in qp._SUB_BYTE_UINT_BOUNDS else output_dtype)


def _fake_dequantize_affine(input: Any, block_size: Any, scale: Any, zero_point: Any, input_dtype: Any,
                            quant_min: Any = None, quant_max: Any = None, output_dtype: Any = None) -> Any:
    import torch
    from torchao.quantization import quant_primitives as qp

    qp._get_reduction_params(block_size, input.size())
    return torch.empty_like(input, dtype=output_dtype or torch.float32)


def _fake_choose_qparams_affine(input: Any, mapping_type: str, block_size: Any, target_dtype: Any, quant_min: Any = None,
                                quant_max: Any = None, eps: Any = None, scale_dtype: Any = None,
                                zero_point_dtype: Any = None, keepdim: bool = False) -> Any:
    import torch
    from torchao.quantization import quant_primitives as qp

    qp._get_and_check_qmin_qmax(target_dtype, quant_min, quant_max)
    shape, dims = qp._get_reduction_params(block_size, input.size())
    shape = ([input.size(i) // b for i, b in enumerate(block_size)] if keepdim
             else [size for i, size in enumerate(shape) if i not in dims])
    # The body's zero point: int32 when asymmetric, else built like the scale (in the input's dtype) and kept.
    zero_dtype = zero_point_dtype or (torch.int32 if mapping_type == qp.MappingType.ASYMMETRIC.name else input.dtype)
    return input.new_empty(shape, dtype=scale_dtype or input.dtype), input.new_empty(shape, dtype=zero_dtype)


def _set_quant_op_kernels(kernels: dict[str, Callable[..., Any]]) -> None:
    import warnings

    import torch
    from torchao.quantization import quant_primitives as qp

    for name, kernel in kernels.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel"
            qp.quant_lib.impl(name, kernel, "CompositeImplicitAutograd")
        getattr(torch.ops.torchao, name).default._dispatch_cache.clear()


@contextlib.contextmanager
def cia_ops_collected_once() -> Iterator[None]:
    """Within this block torch.export's collection of the CompositeImplicitAutograd operators it may keep runs once for
    each state of the operator registry, not once per decomposition; a copy of the set each time (its callers are
    told not to modify it, and one copies it anyway)."""
    import torch
    import torch._export.utils as export_utils
    import torch.export.decomp_utils as decomp_utils
    import torch.export.exported_program as exported_program

    modules = (export_utils, decomp_utils, exported_program)  # the two import the function by name
    stock = export_utils._collect_all_valid_cia_ops
    collected: dict[tuple[Any, ...], set[Any]] = {}

    def registry() -> tuple[Any, ...]:
        return (tuple(torch.ops._dir), len(torch._C._dispatch_get_all_op_names()),
                len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")))

    def once() -> set[Any]:
        found = collected.get(registry())
        if found is None:  # kept under the registry as collecting leaves it (it loads namespaces it walks)
            found = stock()
            collected[registry()] = found
        return set(found)

    for module in modules:
        module._collect_all_valid_cia_ops = once  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module._collect_all_valid_cia_ops = stock  # type: ignore[attr-defined]


@contextlib.contextmanager
def torchao_quant_ops_shape_only() -> Iterator[None]:
    """Within this block, torchao's quantize/dequantize/choose-qparams ops computed on fake tensors (in lowering's
    passes) give their output shapes without running their bodies."""
    import torch
    from torch._inductor.decomposition import decompositions
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    fakes = {"quantize_affine": _fake_quantize_affine, "dequantize_affine": _fake_dequantize_affine,
             "choose_qparams_affine": _fake_choose_qparams_affine}
    # torchao's Python bodies: it hands them to inductor's decomposition table too, where they stay reachable.
    bodies = {name: decompositions[getattr(torch.ops.torchao, name).default] for name in fakes}

    def shape_only(name: str) -> Callable[..., Any]:
        body, fake = bodies[name], fakes[name]

        def kernel(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else kwargs.get("input")
            if type(first) is FakeTensor and get_proxy_mode() is None:  # propagating shapes, not tracing
                return fake(*args, **kwargs)
            return body(*args, **kwargs)

        return kernel

    _set_quant_op_kernels({name: shape_only(name) for name in fakes})
    try:
        yield
    finally:
        _set_quant_op_kernels(bodies)


# --- ExecuTorch runtime backend options (C++ API, through the wheel's shared library) -------------------------

BackendOptionValue = bool | int | str
_OPTION_KEY_BYTES, _OPTION_VALUE_BYTES = 64, 256  # kMaxOptionKeyLength, kMaxOptionValueLength (options.h)
_VARIANT_INDEX = {bool: 0, int: 1, str: 2}  # std::variant<bool, int, std::array<char, 256>>
_SET_OPTION = "_ZN10executorch7runtime10set_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"
_GET_OPTION = "_ZN10executorch7runtime10get_optionEPKcNS0_4SpanINS0_13BackendOptionEEE"


class _BackendOption(ctypes.Structure):
    """``executorch::runtime::BackendOption``: the key, the variant's storage, its index byte (libstdc++)."""

    _fields_ = [("key", ctypes.c_char * _OPTION_KEY_BYTES), ("storage", ctypes.c_ubyte * _OPTION_VALUE_BYTES),
                ("index", ctypes.c_ubyte), ("_pad", ctypes.c_ubyte * 3)]


class _Span(ctypes.Structure):
    """``executorch::runtime::Span<BackendOption>``: a pointer and a length, passed by value."""

    _fields_ = [("data", ctypes.POINTER(_BackendOption)), ("length", ctypes.c_size_t)]


assert ctypes.sizeof(_BackendOption) == 324 and ctypes.sizeof(_Span) == 16


@functools.cache
def _option_functions() -> tuple[Any, Any]:
    import executorch.extension.pybindings.portable_lib  # noqa: F401  (loads the runtime and registers backends)
    import executorch.version

    library = Path(executorch.version.__file__).parent / "lib" / "libexecutorch.so"
    try:
        lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
        functions = getattr(lib, _SET_OPTION), getattr(lib, _GET_OPTION)
    except (OSError, AttributeError) as err:
        raise RuntimeError(f"this ExecuTorch ({library}) does not export executorch::runtime::set_option: backend "
                           f"options need the shared runtime library of the pip wheel (checked with "
                           f"{CHECKED_WITH['executorch']}). {err}") from err
    for function in functions:
        function.argtypes, function.restype = [ctypes.c_char_p, _Span], ctypes.c_uint32
    return functions


def _option(key: str, value: BackendOptionValue | None = None) -> _BackendOption:
    option = _BackendOption()
    option.key = key.encode()
    if value is None:
        return option
    option.index = _VARIANT_INDEX[type(value)]
    if isinstance(value, bool):
        option.storage[0] = int(value)
    elif isinstance(value, int):
        ctypes.memmove(ctypes.addressof(option.storage), ctypes.byref(ctypes.c_int(value)), 4)
    else:
        encoded = value.encode()[: _OPTION_VALUE_BYTES - 1]
        ctypes.memmove(ctypes.addressof(option.storage), encoded, len(encoded))
    return option


def _value(option: _BackendOption) -> BackendOptionValue:
    raw = bytes(option.storage)
    if option.index == _VARIANT_INDEX[bool]:
        return bool(raw[0])
    if option.index == _VARIANT_INDEX[int]:
        return int(ctypes.c_int.from_buffer_copy(raw[:4]).value)
    return raw.split(b"\0", 1)[0].decode()


def backend_options(backend: str, *keys: str) -> dict[str, BackendOptionValue]:
    """The runtime's current values of a backend's options (``executorch::runtime::get_option``)."""
    _, get = _option_functions()
    options = (_BackendOption * len(keys))(*[_option(k) for k in keys])
    error = get(backend.encode(), _Span(options, len(keys)))
    if error:
        raise RuntimeError(f"get_option({backend}, {list(keys)}) failed with ExecuTorch error 0x{error:x}")
    return {o.key.decode(): _value(o) for o in options}


def set_backend_options(backend: str, **values: BackendOptionValue) -> None:
    """Set a backend's runtime options for every method loaded afterwards in this process, and read them back."""
    set_, _ = _option_functions()
    options = (_BackendOption * len(values))(*[_option(k, v) for k, v in values.items()])
    error = set_(backend.encode(), _Span(options, len(values)))
    if error:
        raise RuntimeError(f"set_option({backend}, {values}) failed with ExecuTorch error 0x{error:x} "
                           "(0x20: no such backend in this runtime; 0x12: a value of the wrong type)")
    now = backend_options(backend, *values)
    if now != values:
        raise RuntimeError(f"set_option({backend}, {values}) did not take: the runtime reads back {now}")


# --- XNNPACK's names for the weights it stores in the named data store ----------------------------------------

class _NamedDigest:
    """What ``hashlib.sha256(data)`` returns inside XNNPACK's serializer while a weight is being named."""

    def __init__(self, name: str) -> None:
        self.name = name

    def hexdigest(self) -> str:
        return self.name


def is_xnnpack_weight_name(key: str) -> bool:
    """Whether a data file's key is a weight XNNPACK named in :func:`xnnpack_keys_by_name` (a tensor's module path
    never holds a slash)."""
    return "/" in key


@contextlib.contextmanager
def xnnpack_keys_by_name(namespace: str) -> Iterator[None]:
    """Within this block, XNNPACK names a weight ``<namespace>/<fully qualified name>`` (its scales
    ``scale_<namespace>/<name>``) instead of the sha256 of its bytes. Two methods using one parameter still
    share one entry; a name given to two different contents fails loudly in the named data store."""
    import hashlib
    import threading

    from executorch.backends.xnnpack.operators import node_visitor
    from executorch.backends.xnnpack.utils.utils import get_tensor_name

    visitor, current = node_visitor.NodeVisitor, threading.local()
    original_buffer, original_scales = visitor.get_serialized_buffer_index, visitor.get_quant_params

    class Digests:
        """``hashlib`` for node_visitor: the current weight's name while one is set, the real sha256 otherwise."""

        def __getattr__(self, attr: str) -> Any:
            return getattr(hashlib, attr)

        @staticmethod
        def sha256(data: bytes = b"") -> Any:
            name = getattr(current, "name", None)
            return _NamedDigest(name) if name is not None else hashlib.sha256(data)

    def named(program: Any, node: Any, call: Callable[[], Any]) -> Any:
        if not node_visitor.is_param_node(program, node):
            return call()
        current.name = f"{namespace}/{get_tensor_name(program, node)}"
        try:
            return call()
        finally:
            current.name = None

    def buffer_index(self: Any, tensor: Any, xnn_graph: Any, vals_to_ids: Any, convert_to_nhwc: bool,
                     swap_in_out_for_weights: bool, quant_params: Any, *args: Any, **kwargs: Any) -> Any:
        weight = tensor if quant_params is None else quant_params.q_input  # the node XNNPACK reads the data of
        return named(self.exported_program, weight, lambda: original_buffer(
            self, tensor, xnn_graph, vals_to_ids, convert_to_nhwc, swap_in_out_for_weights, quant_params,
            *args, **kwargs))

    def quant_params(self: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        call = lambda: original_scales(self, params, *args, **kwargs)  # noqa: E731
        if not params.per_channel or getattr(params, "q_input", None) is None:
            return call()
        return named(self.exported_program, params.q_input, call)

    visitor.get_serialized_buffer_index, visitor.get_quant_params = buffer_index, quant_params
    node_visitor.hashlib = Digests()
    try:
        yield
    finally:
        visitor.get_serialized_buffer_index, visitor.get_quant_params = original_buffer, original_scales
        node_visitor.hashlib = hashlib


def pt2e_annotation_key() -> str:
    from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

    return str(Q_ANNOTATION_KEY)


def write_tensor_file(tensors: dict[str, "torch.Tensor"], out: Path) -> None:
    """A ``.ptd`` holding ``tensors`` by name (ExecuTorch's FlatTensor format, as its named data store writes)."""
    import torch
    from executorch.exir._serialize.data_serializer import DataEntry, DataPayload
    from executorch.exir.tensor_layout import TensorLayout
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorSerializer

    buffers, named = [], {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().contiguous()
        named[key] = DataEntry(len(buffers), 64, TensorLayout.from_tensor(tensor))
        buffers.append(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    with open(out, "wb") as fh:
        FlatTensorSerializer().serialize(DataPayload(buffers=buffers, named_data=named)).write_to_file(fh)


def read_tensor_file(path: Path) -> dict[str, "torch.Tensor"]:
    """Every named tensor of a ``.ptd`` (:func:`write_tensor_file`'s, or any FlatTensor file); a ValueError for a file
    that is not one or is cut short."""
    import math

    import torch
    from executorch.exir._serialize._cord import Cord
    from executorch.exir.scalar_type import ScalarType
    from executorch.extension.flat_tensor.serialize.serialize import FlatTensorHeader, FlatTensorSerializer

    dtypes = {"FLOAT": torch.float32, "HALF": torch.float16, "BFLOAT16": torch.bfloat16, "CHAR": torch.int8,
              "BYTE": torch.uint8, "INT": torch.int32, "LONG": torch.int64}
    blob = path.read_bytes()
    header = FlatTensorHeader.from_bytes(blob[8:8 + FlatTensorHeader.EXPECTED_LENGTH])
    if not header.is_valid() or len(blob) < header.segment_base_offset + header.segment_data_size:
        raise ValueError(f"{path} is not a whole ExecuTorch data file (.ptd): "
                         + (f"{len(blob)} bytes of the {header.segment_base_offset + header.segment_data_size} its "
                            "header names, it was cut short" if header.is_valid() else "no FlatTensor header"))
    try:
        payload = FlatTensorSerializer().deserialize(Cord(blob))
    except Exception as e:  # the flatbuffer reader raises several types for a damaged file
        raise ValueError(f"{path} is not a whole ExecuTorch data file (.ptd): {e}") from e
    out = {}
    for key, entry in payload.named_data.items():
        layout = entry.tensor_layout
        dtype = dtypes[ScalarType(layout.scalar_type).name]
        data = payload.buffers[entry.buffer_index]
        need = math.prod(layout.sizes) * dtype.itemsize
        if len(data) < need:
            raise ValueError(f"{path}: tensor {key} needs {need} bytes and the file holds {len(data)} of them: it was "
                             "cut short")
        out[key] = torch.frombuffer(bytearray(data[:need]), dtype=dtype).reshape(layout.sizes) if need else \
            torch.zeros(layout.sizes, dtype=dtype)
    return out
