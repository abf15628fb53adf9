"""Greedy text of ExecuTorch's stock ``TextLLMRunner`` for a program, in whatever runtime runs this script.

Standalone on purpose (it imports only ExecuTorch), so any venv with an ExecuTorch release can run it:

    <venv>/bin/python tests/stock_runner.py model.pte tokenizer.json "The capital of France is" 20 [--data model.ptd]

Prints one JSON line: the ExecuTorch release, the generated text, and the runner's statistics. With ``--verbose``
the runtime's own log lines (which methods the runner uses: "Using method: ...") and library warnings go to stderr;
without it they are dropped, an error's message and traceback still shown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import warnings
from importlib import metadata
from typing import Iterator


@contextlib.contextmanager
def native_stderr_dropped() -> Iterator[None]:
    """The C++ runtime's log lines (and Python's warnings) dropped: file descriptor 2 to /dev/null, restored after (an
    exception's traceback is printed after this block, on the real stderr)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pte")
    parser.add_argument("tokenizer")
    parser.add_argument("prompt")
    parser.add_argument("max_new_tokens", type=int)
    parser.add_argument("--data", default=None, help="the program's .ptd (export.weights=external)")
    parser.add_argument("--turns", type=int, default=1,
                        help="generate this many times with the same prompt in one runner: a conversation going on")
    parser.add_argument("--verbose", action="store_true",
                        help="the runtime's own log lines (which methods it uses) and library warnings on stderr")
    args = parser.parse_args()
    with contextlib.nullcontext() if args.verbose else native_stderr_dropped():
        result = run(args)
    print(json.dumps(result))


def run(args: argparse.Namespace) -> dict:
    # Kernels the programs may call that the runtime does not register by itself.
    with contextlib.suppress(ImportError):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401
    with contextlib.suppress(ImportError):
        import executorch.kernels.quantized  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    turns: list[list[str]] = []
    stats: list[str] = []
    runner = TextLLMRunner(args.pte, args.tokenizer, args.data) if args.data else TextLLMRunner(args.pte, args.tokenizer)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, echo=False, num_bos=1)
    for _ in range(args.turns):  # the runner keeps its position between calls: each turn goes on from the last
        turns.append([])
        runner.generate(args.prompt, config, token_callback=turns[-1].append,
                        stats_callback=lambda s: stats.append(str(s)))
    return {"executorch": metadata.version("executorch"), "text": "".join(turns[0]),
            "turns": ["".join(t) for t in turns], "stats": stats}


if __name__ == "__main__":
    main()
