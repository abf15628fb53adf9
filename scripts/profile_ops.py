"""Where a program's decode time goes, operator by operator (ExecuTorch ETDump + Inspector).

Standalone on purpose (imports only torch and ExecuTorch): it needs a runtime built with the event tracer,
which the pip wheel of ExecuTorch 1.5.1 has and 1.4.1's does not, so run it with the cached 1.5.1 runtime
(``tests/runtimes.py`` builds it; ``pytest tests/test_stock_runners.py`` once does):

    ~/.cache/llm-exporters/runtimes/executorch-1.5.1/bin/python scripts/profile_ops.py \\
        ours=out/model.pte export_llm=bench/export_llm/model.pte

Each program prefills a random prompt, then decodes ``--steps`` tokens one at a time through its one-token
method (``decode_one_token``, ``decode``, else ``forward``); the table is the mean time per decode step of
each operator (delegate calls are one row per call site), side by side, slowest first.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
import time
from pathlib import Path

import torch

STEP_METHODS = ("decode_one_token", "decode", "forward")
PROMPT_METHODS = ("prefill", "forward")


def profile(pte: Path, prompt_tokens: int, steps: int) -> tuple[dict[str, float], float]:
    """Mean milliseconds per decode step of each operator (by name), and the wall ms per step."""
    from executorch.devtools import Inspector
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(str(pte), enable_etdump=True, debug_buffer_size=0)
    names = set(program.method_names)
    prompt = program.load_method(next(m for m in PROMPT_METHODS if m in names))
    step_name = next(m for m in STEP_METHODS if m in names)
    step = program.load_method(step_name)
    logits = prompt.execute([torch.randint(0, 1000, (1, prompt_tokens)), torch.tensor([0])])[0]
    start = time.perf_counter()
    for i in range(steps):
        token = int(logits.reshape(-1, logits.shape[-1])[-1].argmax())
        logits = step.execute([torch.tensor([[token]]), torch.tensor([prompt_tokens + i])])[0]
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    with tempfile.TemporaryDirectory() as tmp:
        etdump = Path(tmp) / "etdump.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(tmp) / "debug.bin"))
        inspector = Inspector(etdump_path=str(etdump))
    # One "Execute" block per method, each event holding one sample per call; the step method's block
    # is the last one, and its last ``steps`` samples are the decode calls (forward also ran the prompt).
    step_block = [b for b in inspector.event_blocks if b.name == "Execute"][-1]
    per_op: dict[str, float] = collections.defaultdict(float)
    for event in step_block.events:
        if event.perf_data is not None and event.name != "OPERATOR_CALL":  # it wraps the native_call beside it
            samples = event.perf_data.raw[-steps:]
            per_op[event.name] += sum(samples) / len(samples)
    return dict(per_op), wall_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("programs", nargs="+", help="label=path.pte")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    with contextlib.suppress(ImportError):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    with contextlib.suppress(ImportError):
        import executorch.kernels.quantized  # noqa: F401
    results = {}
    for item in args.programs:
        label, _, path = item.partition("=")
        results[label] = profile(Path(path), args.prompt_tokens, args.steps)
    labels = list(results)
    ops = sorted({op for per_op, _ in results.values() for op in per_op},
                 key=lambda op: -max(results[label][0].get(op, 0.0) for label in labels))
    print("| operator | " + " | ".join(f"{label} ms/step" for label in labels) + " |")
    print("|---|" + "---:|" * len(labels))
    for op in ops[:args.top]:
        print(f"| {op} | " + " | ".join(f"{results[label][0].get(op, 0.0):.3f}" for label in labels) + " |")
    print("| **sum of operators** | " + " | ".join(f"{sum(results[label][0].values()):.3f}" for label in labels) + " |")
    print("| **wall per step** | " + " | ".join(f"{results[label][1]:.3f}" for label in labels) + " |")


if __name__ == "__main__":
    main()
