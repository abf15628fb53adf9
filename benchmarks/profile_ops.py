"""Where a program's decode time goes, operator by operator (ExecuTorch ETDump + Inspector).

    python -m benchmarks.profile_ops ours=bench/smollm2/llm-exporters/model.pte \\
        export_llm=bench/smollm2/export_llm/model.pte
    python -m benchmarks.profile_ops --preset smollm2 [--quant 8da4w]   # export the preset first, then profile it

It needs a runtime built with the event tracer, which the pip wheel of ExecuTorch 1.5.1 (this project's) has
and 1.4.1's does not. It profiles in this interpreter, or in another runtime's (``--runtime-python``): that part
of this file imports only torch and ExecuTorch, so any runtime's interpreter runs it directly:

    <venv>/bin/python benchmarks/profile_ops.py --here ours=model.pte

Each program prefills a random prompt, then decodes ``--steps`` tokens one at a time through its one-token
method (``decode_one_token``, ``decode``, else ``forward``). Two tables, programs side by side, mean per decode
step: where the time goes (delegate calls, XNNPACK operators inside them, operators outside any delegate),
and the slowest operator kinds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

STEP_METHODS = ("decode_one_token", "decode", "forward")
PROMPT_METHODS = ("prefill", "forward")


@dataclass
class DecodeProfile:
    """Mean per decode step, from the runtime's own events."""

    wall_ms: float  # Python's view: one execute() call
    execute_ms: float = 0.0  # Method::execute
    delegate_calls: int = 0
    delegate_ms: float = 0.0  # inside DELEGATE_CALL events, XNNPACK's setup and invoke included
    delegated_ops: int = 0  # XNNPACK operators inside the delegate calls
    delegated_ops_ms: float = 0.0
    portable_calls: int = 0  # operators the program runs outside any delegate (portable / custom kernels)
    portable_ms: float = 0.0
    per_operator: dict[str, float] = field(default_factory=dict)  # ms by operator kind ("#N" dropped)


def profile(pte: Path, prompt_tokens: int, steps: int) -> DecodeProfile:
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte), enable_etdump=True, debug_buffer_size=0)
    names = set(program.method_names)
    prompt = program.load_method(next(m for m in PROMPT_METHODS if m in names))
    step = program.load_method(next(m for m in STEP_METHODS if m in names))
    vocab = int(program.load_method("get_vocab_size").execute([])[0]) if "get_vocab_size" in names else 1000
    prompt_ids = torch.randint(0, min(vocab, 1000), (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    logits = prompt.execute([prompt_ids, torch.tensor([0])])[0]
    start = time.perf_counter()
    for i in range(steps):
        token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        logits = step.execute([torch.tensor([[token]]), torch.tensor([prompt_tokens + i])])[0]
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "etdump.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(tmp) / "debug.bin"))
        if not etdump.is_file():
            from importlib import metadata

            raise SystemExit(f"this runtime (ExecuTorch {metadata.version('executorch')}, {sys.executable}) wrote no "
                             "ETDump: it was built without the event tracer. Profile in a runtime that has it (ExecuTorch "
                             "1.5.1's pip wheel: give --runtime-python).")
        inspector = Inspector(etdump_path=str(etdump))
    # One "Execute" block per method, each event holding one sample per call; the step method's block
    # is the last one, and its last ``steps`` samples are the decode calls (forward also ran the prompt).
    step_block = [b for b in inspector.event_blocks if b.name == "Execute"][-1]
    result = DecodeProfile(wall_ms)
    per_operator: dict[str, float] = collections.defaultdict(float)
    for event in step_block.events:
        if event.perf_data is None or event.name == "OPERATOR_CALL":  # it wraps the native call beside it
            continue
        samples = event.perf_data.raw[-steps:]
        ms = sum(samples) / len(samples)
        if event.name == "Method::execute":
            result.execute_ms += ms
        elif event.name == "DELEGATE_CALL":
            result.delegate_calls += 1
            result.delegate_ms += ms
        elif event.name.startswith(("native_call_", "llama::", "quantized_decomposed::")):
            result.portable_calls += 1
            result.portable_ms += ms
            per_operator[event.name.removeprefix("native_call_")] += ms
        else:  # an XNNPACK operator, reported by the delegate ("Fully Connected (NC, ...) GEMM #3")
            result.delegated_ops += 1
            result.delegated_ops_ms += ms
            per_operator["xnnpack: " + re.sub(r" #\d+$", "", event.name)] += ms
    result.per_operator = dict(per_operator)
    return result


ROWS = [
    ("wall per step (Python)", "wall_ms", "{:.3f} ms"),
    ("Method::execute", "execute_ms", "{:.3f} ms"),
    ("delegate calls", "delegate_calls", "{}"),
    ("time in delegate calls", "delegate_ms", "{:.3f} ms"),
    ("XNNPACK operators inside them", "delegated_ops", "{}"),
    ("time in those operators", "delegated_ops_ms", "{:.3f} ms"),
    ("operators outside delegates", "portable_calls", "{}"),
    ("time in those operators", "portable_ms", "{:.3f} ms"),
]


def tables(results: dict[str, DecodeProfile], top: int) -> str:
    labels = list(results)
    header = "| per decode step | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(labels)
    lines = [header]
    for title, attr, fmt in ROWS:
        lines.append(f"| {title} | " + " | ".join(fmt.format(getattr(results[label], attr)) for label in labels) + " |")
    ops = sorted({op for r in results.values() for op in r.per_operator},
                 key=lambda op: -max(r.per_operator.get(op, 0.0) for r in results.values()))
    lines.append("\n" + header.replace("per decode step", "operator (ms per decode step)"))
    for op in ops[:top]:
        lines.append(f"| {op} | " + " | ".join(f"{results[label].per_operator.get(op, 0.0):.3f}" for label in labels)
                     + " |")
    return "\n".join(lines)


def export_programs(args: argparse.Namespace) -> list[str]:
    """Export ``--preset`` with our exporter (in this project's environment); ``["ours=<pte>"]``."""
    from benchmarks.exporting import export_preset
    from benchmarks.presets import PRESETS, preset_of

    if args.preset not in PRESETS:
        raise SystemExit(f"--preset {args.preset}: not a preset; known: {', '.join(PRESETS)} (benchmarks/presets.py).")
    out = args.out or Path(tempfile.mkdtemp(prefix="profile_ops_"))
    print(f"exporting {args.preset} ({args.quant}, max_seq_len {args.max_seq_len}) into {out} ...", flush=True)
    result = export_preset(preset_of(args), out, [f"quant={args.quant}", f"export.max_seq_len={args.max_seq_len}",
                                                  "validate=false", "bench=false"])
    return [f"ours={result.pte_path}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("programs", nargs="*", help="label=path.pte")
    parser.add_argument("--preset", default=None, help="export this preset (benchmarks/presets.py) and profile it")
    parser.add_argument("--layers", type=int, default=None, help="keep only the preset's first N decoder layers")
    parser.add_argument("--quant", default="8da4w", help="quant option of the --preset export (conf/quant)")
    parser.add_argument("--max-seq-len", type=int, default=256, help="context of the --preset export")
    parser.add_argument("--out", type=Path, default=None, help="folder for the --preset export (default: a temp dir)")
    parser.add_argument("--runtime-python", type=Path, default=None,
                        help="interpreter of another ExecuTorch runtime with the event tracer (default: this one)")
    parser.add_argument("--here", action="store_true",
                        help="profile in this interpreter (its ExecuTorch runtime must have the event tracer)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    if not args.programs and args.preset is None:
        parser.error("give programs (label=path.pte) or --preset NAME")
    if args.here and args.preset:
        parser.error("--here profiles given programs only: export with --preset from this project's environment")
    if not args.here:
        runtime = args.runtime_python or Path(sys.executable)
        if not runtime.is_file():
            raise SystemExit(f"--runtime-python {runtime}: no such interpreter; give the python of a virtual "
                             "environment whose ExecuTorch runtime has the event tracer (the pip wheel of 1.5.1 has).")
        programs = [*args.programs, *(export_programs(args) if args.preset else [])]
        cmd = [str(runtime), str(Path(__file__).resolve()), "--here", *programs, "--prompt-tokens",
               str(args.prompt_tokens), "--steps", str(args.steps), "--top", str(args.top)]
        sys.exit(subprocess.run(cmd).returncode)
    with contextlib.suppress(ImportError):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    with contextlib.suppress(ImportError):
        import executorch.kernels.quantized  # noqa: F401
    results = {}
    for item in args.programs:
        label, _, path = item.partition("=")
        results[label] = profile(Path(path), args.prompt_tokens, args.steps)
    print(tables(results, args.top))


if __name__ == "__main__":
    main()
