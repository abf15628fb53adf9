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
(:func:`exporters.program.internals.xnnpack_keys_by_name`), prefixed with :func:`structure_namespace`.

A program whose data file is missing crashes ExecuTorch 1.5.1's runtime in ``load_method`` (XNNPACK reads a
null data map) rather than raising, so every reader here goes through :func:`data_file_for`, which refuses
before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from exporters.errors import UserError, listed
from exporters.manifest import MANIFEST_FILE, Manifest, RuntimeNeeds, bundle_manifest
from exporters.output.files import sha256_of
from exporters.program.internals import read_program_header
from exporters.program.versions import EXECUTORCH
from models.lora import ADAPTER_NAME, adapter_of_parameter

if TYPE_CHECKING:
    from exporters.config import BackendConfig, ExportSection
    from exporters.manifest import DataFile

DATA_SUFFIX = ".ptd"
# The named data store's tag for the base's data file. Only ExecuTorch's file writing sees tags (the program refers
# to weights by name, runtimes are given the data files' paths), so fixed tags keep the program the same bytes
# whatever the output name.
DATA_TAG = "weights"
ADAPTER_TAG_PREFIX = "adapter-"


class DataFileError(UserError):
    """A program's data file is missing, renamed, or from another export."""


def check_weights(export: "ExportSection", backend: "BackendConfig", adapters: Sequence[str] = ()) -> None:
    """``export.weights`` is one the backend can write (with these adapters), refused before any work otherwise."""
    if export.weights not in backend.supported_weights:
        raise UserError(
            f"export.weights={export.weights}: backend={backend.name} keeps its weights inside its own compiled "
            f"blobs, which ExecuTorch cannot move to a data file; it supports export.weights="
            f"{listed(backend.supported_weights)}. Use export.weights=program, or backend=xnnpack / portable for "
            "a .ptd. Nothing was exported.")
    if adapters and export.weights == "external" and not backend.adapter_data_files:
        raise UserError(
            f"export.weights=external with model.adapters ({', '.join(adapters)}) on backend={backend.name}: ExecuTorch "
            f"{EXECUTORCH} folds each method's transposed weights into new constants named per method "
            "(_prop_tensor_constant<N>), and an adapter's methods number theirs differently from the base's, so "
            "two different tensors get one name in the data file. Use backend=xnnpack (each adapter in its own "
            ".ptd), or export.weights=program. Nothing was exported.")


def data_tag(adapter: str | None) -> str:
    """The data file a weight goes to: the base's, or one per LoRA adapter (swapped without the base)."""
    return DATA_TAG if adapter is None else ADAPTER_TAG_PREFIX + adapter


def data_path_for(pte: Path, adapter: str | None = None) -> Path:
    """The data file written beside ``pte``: ``model.pte`` -> ``model.ptd`` for the base, ``model.<adapter>.ptd``
    for an adapter's A and B matrices (provisional and rejected names too)."""
    return pte.with_suffix(DATA_SUFFIX) if adapter is None else pte.with_name(f"{pte.stem}.{adapter}{DATA_SUFFIX}")


def placed(data: DataFile | None, adapter: str | None, pte: Path) -> DataFile | None:
    """The data file of the base (or of ``adapter``) as it will be named beside ``pte``."""
    return None if data is None else dataclasses.replace(data, file=data_path_for(pte, adapter).name)

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


def tag_weights_by_data_file() -> Any:
    """A pass (run after ``to_edge``, before partitioning) marking every constant with its data file's tag: an
    adapter's A and B matrices for that adapter's file, everything else for the base's. The backend then stores
    what it takes of them there (XNNPACK reads ``meta["custom"]["delegate_constant_tag"]``), and emit puts the
    non-delegated ones by the same tag (:func:`external_constant_tag`).

    It reads the exported program's signature (a parameter's module path names its adapter: PEFT's
    ``<layer>.lora_A.<adapter>.weight``), which survives torchao's split of a quantized weight into new
    placeholders in ``to_edge``."""
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult


    class TagWeightsByDataFile(ExportedProgramPassBase):
        def call(self, exported_program: Any) -> ExportedProgramPassResult:
            signature = exported_program.graph_signature
            paths = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
                     **signature.inputs_to_lifted_tensor_constants}
            for node in exported_program.graph.nodes:
                if node.op == "placeholder" and node.name in paths:
                    tag = data_tag(adapter_of_parameter(paths[node.name]))
                    node.meta.setdefault("custom", {})["delegate_constant_tag"] = tag
            return ExportedProgramPassResult(exported_program, True)

    return TagWeightsByDataFile()


def external_constant_tag(node: Any) -> str:
    """``ExecutorchBackendConfig.external_constants``: the weights of non-delegated ops go to the data file their
    placeholder was tagged for (the base's if untagged)."""
    return node.meta.get("custom", {}).get("delegate_constant_tag", DATA_TAG)


def references_external_data(pte: Path) -> bool:
    """Whether the program reads weights it does not hold: a constant tensor placed outside the file (read from
    the program's flatbuffer only). Our programs with external weights always have one: the token embedding's
    table, which no delegate takes. Delegates' own references cannot be told from outside their blobs (an
    XNNPACK bf16 program, for one, holds its weights with no named data)."""
    from executorch.exir.schema import TensorDataLocation


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


def listed_data_files(pte: Path) -> dict[str | None, tuple[str, str]] | None:
    """The data files the manifest beside ``pte`` lists for it, (file, sha256) by owner (None: the base; else the
    adapter's name); None when no manifest there describes this program. Reads a run's manifest and a release
    bundle's (``exporters.package``), which carries the same ``data`` and ``adapters`` entries."""

    path = pte.parent / MANIFEST_FILE
    if not path.is_file():
        return None
    raw = bundle_manifest(path)
    if raw is not None:
        if pte.name not in raw.get("files", {}) or raw.get("data") is None:
            return None
        data, adapters = raw["data"], {n: a.get("data") for n, a in (raw.get("adapters") or {}).items()}
        owners = {None: data, **adapters}
        return {owner: (f["file"], f["sha256"]) for owner, f in owners.items() if f is not None}
    manifest = Manifest.read(path)
    if manifest.program.file != pte.name or manifest.data is None:
        return None
    owners = {None: manifest.data, **{n: a.data for n, a in manifest.adapters.items()}}
    return {owner: (f.file, f.sha256) for owner, f in owners.items() if f is not None}


def data_files_beside(pte: Path, adapters: Sequence[str] | None = None) -> list[Path]:
    """The data files to load with ``pte``, checked: the base's (:func:`data_file_for`) and each adapter's (all,
    or those of ``adapters``), as the manifest beside it lists them (present, same sha256); without a manifest,
    ``<stem>.ptd`` if the program needs one and the ``<stem>.<adapter>.ptd`` beside it."""

    pte = Path(pte)
    wanted = lambda owner: owner is None or adapters is None or owner in adapters  # noqa: E731
    listed_files = listed_data_files(pte)
    if listed_files is not None:
        return [data_file_for(pte, expected) for owner, expected in listed_files.items()  # type: ignore[misc]
                if wanted(owner)]
    base = data_file_for(pte)
    if base is None:
        return []
    beside = {p.name.removeprefix(f"{pte.stem}.").removesuffix(DATA_SUFFIX): p
              for p in sorted(pte.parent.glob(f"{pte.stem}.*{DATA_SUFFIX}"))}
    return [base, *(path for name, path in beside.items() if ADAPTER_NAME.match(name) and wanted(name))]


def runtime_needs(packed_once: str, program: str, data: str | None,
                  adapter_data: dict[str, str] | None = None) -> "RuntimeNeeds":

    if data is None:
        load = f"{program} alone: it holds its weights."
    elif not adapter_data:
        load = (f"{program} together with {data}, which holds its weights (given alone, ExecuTorch {EXECUTORCH} fails "
                f"in load_method). C++: Module(\"{program}\", \"{data}\"); llama_main --model_path={program} "
                f"--data_paths={data}; Python: Runtime.get().load_program(\"{program}\", data_path=\"{data}\"), "
                f"TextLLMRunner(\"{program}\", tokenizer, data_path=\"{data}\").")
    else:
        name, file = next(iter(adapter_data.items()))
        load = (f"{program} together with {data} (the base's weights) and, for an adapter's methods, that adapter's "
                f"data file ({', '.join(f'{n}: {f}' for n, f in adapter_data.items())}); the base's methods need "
                f"{data} alone. C++: Module(\"{program}\", {{\"{data}\", \"{file}\"}}) for the base and {name}; "
                f"llama_main --model_path={program} --data_paths={data},{file} (comma-separated). ExecuTorch {EXECUTORCH}'s "
                "Python runtime takes one data file: exporters.runtime.programs.LoadedProgram merges them into one "
                "temporary file. Swap an adapter by replacing its data file with one exported under the same name, "
                "ranks and targets (the program is then the same bytes).")
    return RuntimeNeeds(load=load, packed_once=packed_once)
