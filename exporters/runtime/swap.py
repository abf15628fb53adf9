"""Swapping adapters in a loaded program (``export.adapters=swappable``), as an app does: what ``set_adapter`` takes,
read from the program itself, and an adapter from its name, its ``.ptd`` or a PEFT folder.

Everything an adapter could get wrong (its rank, its targets, its shapes, its dtype, a cut file) is checked before
``set_adapter`` runs, so a refused adapter leaves the program computing with the one it had.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from exporters.errors import UserError
from exporters.program.internals import read_tensor_file
from exporters.program.swappable import ADAPTER_FOLDER, LORA_INPUTS_CONSTANT, adapter_file
from exporters.runtime.programs import LoadedProgram
from models.lora import read_peft_folder
from models.lora_slots import SET_ADAPTER, SlotError, SlotGeometry, pack


def is_swappable(program: LoadedProgram) -> bool:
    return SET_ADAPTER in program.method_names


class Slots:
    """A swappable program's LoRA slots: the adapter it computes with, set by name, ``.ptd`` or PEFT folder."""

    def __init__(self, program: LoadedProgram, run: Path) -> None:
        self.program, self.run = program, run
        names = str(program.constant(LORA_INPUTS_CONSTANT)).split(",")
        inputs = program.inputs_of(SET_ADAPTER)
        self.geometry = SlotGeometry.of_inputs(names, [shape for shape, _ in inputs], [dtype for _, dtype in inputs])
        self.current: str | None = None  # None: all zeros, the base

    def tensors_of(self, adapter: str) -> dict[str, torch.Tensor]:
        """``adapter``: a name the export wrote (``adapters/<name>.ptd``), a ``.ptd`` file, or a PEFT folder."""

        path = Path(adapter).expanduser()
        exported = adapter_file(self.run, adapter)
        if path.is_dir():
            config, modules = read_peft_folder(path.name, path)
            return pack(str(path), config, modules, self.geometry)
        if path.suffix == ".ptd" or exported.is_file():
            file = path if path.suffix == ".ptd" else exported
            if not file.is_file():
                raise UserError(f"adapter={adapter}: no such file. {self._choices()}")
            try:
                tensors = read_tensor_file(file)
            except ValueError as e:
                raise SlotError(f"adapter={adapter}: {e}. Copy the file again, or write it anew with "
                                "python -m exporters.adapter <run> <peft folder> out=<file.ptd>.") from e
            self.check(adapter, tensors)
            return tensors
        raise UserError(f"adapter={adapter} is neither an adapter of this program nor a .ptd file nor a PEFT folder. "
                        + self._choices())

    def exported(self) -> list[str]:
        """The adapters the export wrote beside the program (``adapters/<name>.ptd``), by name."""
        return sorted(p.stem for p in (self.run / ADAPTER_FOLDER).glob("*.ptd"))

    def _choices(self) -> str:
        given = self.exported()
        return (f"The program's own adapters: {', '.join(given)}; " if given else "The export gave no adapters; ") + (
            "or give a .ptd file or a PEFT folder (adapter_config.json + adapter_model.safetensors).")

    def check(self, adapter: str, tensors: dict[str, torch.Tensor]) -> None:
        """The tensors are exactly set_adapter's inputs: names, shapes and dtype."""
        shapes = self.geometry.input_shapes()
        if sorted(tensors) != sorted(shapes):
            raise SlotError(f"adapter {adapter} holds {', '.join(sorted(tensors))}, and this program's set_adapter "
                            f"takes {', '.join(self.geometry.input_names())} ({self.geometry.describe()}). It was "
                            "written for another program: write it for this one with python -m exporters.adapter "
                            "<run> <peft folder> out=<file.ptd>.")
        for name, shape in shapes.items():
            got, dtype = tensors[name], self.geometry.input_dtype(name)
            if tuple(got.shape) != shape or got.dtype != dtype:
                have, want = (str(t).removeprefix("torch.") for t in (got.dtype, dtype))
                raise SlotError(f"adapter {adapter}: {name} is {have} {list(got.shape)}, and this program's "
                                f"set_adapter takes {want} "
                                f"{list(shape)} ({self.geometry.describe()}). It was written for another program "
                                "(another base, rank or dtype): write it for this one with python -m "
                                "exporters.adapter <run> <peft folder> out=<file.ptd>.")

    def set(self, adapter: str | None) -> float:
        """Compute with ``adapter`` from the next call on (None: the base); the seconds ``set_adapter`` took."""
        tensors = self.geometry.zeros() if adapter is None else self.tensors_of(adapter)
        start = time.perf_counter()
        self.program.run(SET_ADAPTER, *(tensors[n] for n in self.geometry.input_names()))
        self.current = adapter
        return time.perf_counter() - start
