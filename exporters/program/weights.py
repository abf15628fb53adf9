"""Where a program's weights live (``export.weights``), and which data file a reader must load with a program.

``program``: one self-contained ``.pte``. ``external``: the weights go to a ``.ptd`` beside it (``model.pte`` +
``model.ptd``), ExecuTorch's program-data separation: apps update weights without a new program, map the
weights apart from it, and swap one data file for another of the same shapes.

Two tags put every weight there. Delegated weights: each constant placeholder is tagged before partitioning, so
the backend hands them to the named data store marked for the data file (XNNPACK reads
``meta["custom"]["delegate_constant_tag"]``; a tag set before ``to_edge`` is lost on torchao's quantized
weights, which ``to_edge`` splits into new placeholders). Weights of non-delegated ops:
``ExecutorchBackendConfig(external_constants=...)`` at emit. XNNPACK names its weights by their bytes' sha256,
which would make the ``.pte`` differ with every checkpoint; during lowering they are named by tensor instead
(:func:`exporters.internals.xnnpack_keys_by_name`), prefixed with :func:`structure_namespace`.

A program whose data file is missing crashes ExecuTorch 1.5.1's runtime in ``load_method`` (XNNPACK reads a
null data map) rather than raising, so every reader here goes through :func:`data_file_for`, which refuses
before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from exporters.errors import UserError, listed
from exporters.program.files import sha256_of

if TYPE_CHECKING:
    from exporters.config import BackendConfig, ExportSection

DATA_SUFFIX = ".ptd"
# The named data store's tag for the data file. Only ExecuTorch's file writing sees it (the program refers to
# weights by name, runtimes are given the data file's path), so one fixed tag keeps the program the same bytes
# whatever the output name.
DATA_TAG = "weights"


class DataFileError(UserError):
    """A program's data file is missing, renamed, or from another export."""


def check_weights(export: "ExportSection", backend: "BackendConfig") -> None:
    """``export.weights`` is one the backend can write, refused before any work otherwise."""
    if export.weights not in backend.supported_weights:
        raise UserError(
            f"export.weights={export.weights}: backend={backend.name} keeps its weights inside its own compiled "
            f"blobs, which ExecuTorch cannot move to a data file; it supports export.weights="
            f"{listed(backend.supported_weights)}. Use export.weights=program, or backend=xnnpack / portable for "
            "a .ptd. Nothing was exported.")


def data_path_for(pte: Path) -> Path:
    """The data file written beside ``pte``: ``model.pte`` -> ``model.ptd`` (provisional and rejected names too)."""
    return pte.with_suffix(DATA_SUFFIX)


def structure_namespace(programs: dict[str, Any]) -> str:
    """A short name of the program's structure: every constant's name, shape and dtype over all methods.

    The same for any weights of these shapes, different for another model or quantization. It prefixes the
    names XNNPACK's weights get in the named data store, so that two different programs never share a name
    (XNNPACK's weight cache, shared by every program a process loads, matches packed weights by name)."""
    entries = set()
    for program in programs.values():
        for table in (program.state_dict, program.constants):
            for name, tensor in table.items():
                entries.add((name, tuple(tensor.shape), str(tensor.dtype)))
    return "w" + hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()[:12]


def tag_delegated_weights(tag: str) -> Callable[[Any], Any]:
    """A transform pass (run after ``to_edge``, before partitioning) marking every constant for the data file
    ``tag``: the backend then stores what it takes of them there."""
    from executorch.exir.pass_base import PassResult

    def tag_placeholders(graph_module: Any) -> Any:
        for node in graph_module.graph.nodes:
            if node.op == "placeholder":
                node.meta.setdefault("custom", {})["delegate_constant_tag"] = tag
        return PassResult(graph_module, True)

    return tag_placeholders


def external_constants(tag: str) -> Callable[[Any], str]:
    """``ExecutorchBackendConfig.external_constants``: the weights of non-delegated ops go to the data file too."""
    return lambda node: tag


def references_external_data(pte: Path) -> bool:
    """Whether the program reads weights it does not hold: a constant tensor placed outside the file (read from
    the program's flatbuffer only). Our programs with external weights always have one: the token embedding's
    table, which no delegate takes. Delegates' own references cannot be told from outside their blobs (an
    XNNPACK bf16 program, for one, holds its weights with no named data)."""
    from executorch.exir.schema import TensorDataLocation

    from exporters.internals import read_program_header

    program = read_program_header(pte)
    return any(getattr(getattr(value.val, "extra_tensor_info", None), "location", None) == TensorDataLocation.EXTERNAL
               for plan in program.execution_plan for value in plan.values)


def data_file_for(pte: Path, expected: tuple[str, str] | None = None) -> Path | None:
    """The data file to load with ``pte``, checked; None for a self-contained program.

    ``expected`` is the manifest's (file name, sha256) of it when there is a manifest: the file must exist
    beside the program and have that hash. Without one, a program that references external data needs
    ``<stem>.ptd`` beside it."""
    pte = Path(pte)
    if expected is None:
        if not references_external_data(pte):
            return None
        data = data_path_for(pte)
        if not data.is_file():
            raise DataFileError(
                f"{pte} keeps its weights in a separate data file (it was exported with export.weights=external), "
                f"and {data.name} is not beside it. Copy the .ptd written with this program next to it as "
                f"{data}, or re-export with export.weights=program for a single file.")
        return data
    name, sha256 = expected
    data = pte.parent / name
    if not data.is_file():
        raise DataFileError(
            f"{pte} keeps its weights in {name}, which is missing from {pte.parent} (its manifest lists it with "
            f"sha256 {sha256[:16]}...). Copy the {name} written with this program beside it, or re-export; an "
            f"ExecuTorch runtime given {pte.name} alone cannot load its methods.")
    actual = sha256_of(data)
    if actual != sha256:
        raise DataFileError(
            f"{data} is not the data file exported with {pte.name}: its sha256 is {actual[:16]}..., the manifest "
            f"beside the program lists {sha256[:16]}... . It comes from another export (or was changed). Put the "
            f"{name} written with this program beside it; to swap in other weights of the same shapes on purpose, "
            f"copy that export's manifest.json along with its {name}.")
    return data


def data_file_beside(pte: Path) -> Path | None:
    """:func:`data_file_for` with what the manifest beside ``pte`` (if it describes this program) says of it."""
    from exporters.manifest import MANIFEST_FILE, Manifest

    pte = Path(pte)
    manifest_path = pte.parent / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = Manifest.read(manifest_path)
        if manifest.program.file == pte.name and manifest.data is not None:
            return data_file_for(pte, (manifest.data.file, manifest.data.sha256))
    return data_file_for(pte)


#: What a runtime needs so that the methods of a program share one copy of the weights in memory, by backend.
PACKED_ONCE = {
    "xnnpack": (
        "XNNPACK packs weights at load. Turn on its weight cache before loading methods: the runtime option "
        "weight_cache_enabled=true of backend XnnpackBackend (C++: executorch::runtime::set_option, or per load "
        "in a LoadBackendOptionsMap), or build the runtime with EXECUTORCH_XNNPACK_ENABLE_WEIGHT_CACHE=ON "
        "(ExecuTorch's Android and Apple presets do; the pip wheel does not). Without it every loaded method packs "
        "its own copy: bench.rss_after_load_mb (cache on) against bench.rss_after_load_without_weight_cache_mb "
        "(off), when the bench ran. Our tools turn it on."),
    "portable": "Nothing: the portable kernels read the weights where they are stored, once for all methods.",
    "openvino": (
        "Never shared: each method's OpenVINO blob holds its own copy of the weights (in the file and in memory). "
        "The runtime needs ExecuTorch's OpenVINO backend and openvino 2025.x's libopenvino_c.so (found from the "
        "openvino Python package, or OPENVINO_LIB_PATH); the device picks the precision it computes in (bf16 on "
        "CPUs with AMX or AVX512-BF16)."),
}


def runtime_needs(backend: str, program: str, data: str | None) -> "RuntimeNeeds":
    from exporters.manifest import RuntimeNeeds

    if data is None:
        load = f"{program} alone: it holds its weights."
    else:
        load = (f"{program} together with {data}, which holds its weights (given alone, ExecuTorch 1.5.1 fails "
                f"in load_method). C++: Module(\"{program}\", \"{data}\"); llama_main --model_path={program} "
                f"--data_paths={data}; Python: Runtime.get().load_program(\"{program}\", data_path=\"{data}\"), "
                f"TextLLMRunner(\"{program}\", tokenizer, data_path=\"{data}\").")
    packed = PACKED_ONCE.get(backend, f"The {backend} delegate's own loader decides (not measured here).")
    return RuntimeNeeds(load=load, packed_once=packed)
