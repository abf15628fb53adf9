"""``python -m exporters.adapter <run> <peft folder> out=<file.ptd>``: any PEFT LoRA adapter as a file a swappable
program's ``set_adapter`` takes (``export.adapters=swappable``), checked against that program's slots.

The adapter may have been trained after the export: the program is not exported again. Its tensors are named as
``set_adapter``'s inputs (the program's constant ``get_lora_inputs``), laid out by ``models.lora_slots.pack``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from exporters.errors import REPORTED_ERRORS, UserError
from exporters.program.internals import write_tensor_file
from exporters.output.files import private_path
from exporters.output.folder import check_writable
from exporters.runtime.generator import resolve_program
from exporters.runtime.programs import LoadedProgram
from exporters.runtime.swap import Slots, is_swappable

USAGE = """usage: python -m exporters.adapter <run folder or .pte> <PEFT adapter folder> out=<file.ptd>

Writes the PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) as a .ptd that the program's
set_adapter takes; the program must have been exported with export.adapters=swappable, and the adapter's targets
and ranks must fit its slots (get_lora_inputs, get_lora_max_rank). Then:
  python -m exporters.generate <run> prompt="..." adapter=<file.ptd>
"""


def write_adapter(run: str | Path, peft_folder: str | Path, out: str | Path) -> Path:
    """Check the adapter against the program's slots and write it to ``out``; refused adapters write nothing."""
    pte = resolve_program(run)
    out = Path(out).expanduser()
    if out.suffix != ".ptd":
        raise UserError(f"out={out}: name the file *.ptd (an ExecuTorch data file).")
    program = LoadedProgram(pte)
    if not is_swappable(program):
        raise UserError(f"{pte} has no set_adapter method: it was exported with export.adapters=methods (or without "
                        "adapters). Export it again with export.adapters=swappable to load adapters at run time.")
    slots = Slots(program, pte.parent)
    folder = Path(peft_folder).expanduser()
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder. Give the folder PeftModel.save_pretrained wrote.")
    tensors = slots.tensors_of(str(folder))
    check_writable(out.parent, "out=", "Give a folder you can write to.")
    staged = private_path(out, "staged")  # renamed into place whole: never a half-written file under its name
    try:
        write_tensor_file(tensors, staged)
        os.replace(staged, out)
    finally:
        staged.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    outs = [a.removeprefix("out=") for a in args if a.startswith("out=")]
    rest = [a for a in args if not a.startswith("out=")]
    try:
        if len(rest) != 2 or len(outs) != 1:
            raise UserError(USAGE)
        written = write_adapter(rest[0], rest[1], outs[0])
    except REPORTED_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {written} ({written.stat().st_size / 1e6:.2f} MB) for {rest[0]}; use it with: python -m "
          f"exporters.generate {rest[0]} prompt=\"...\" adapter={written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
