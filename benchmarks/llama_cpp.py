"""llama.cpp's speculative decoding on the same GGUF pair and tasks as ``benchmarks.speculative``: the runtime peer.

    python -m benchmarks.llama_cpp --bin /work/llamacpp/build/bin [--tokens 128] [--repeats 2] [--draft-tokens 1,7]
        [--out docs/results/llama-cpp-qwen2.5-coder.json]

llama.cpp runs the GGUF files as they are (Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct draft, their Q4_K_M
mix), greedy, ``--ignore-eos``, on this machine's threads: plain decoding (``llama-completion``), prompt lookup
(``llama-speculative-simple --spec-type ngram-simple``, its counterpart of our ``speculative=lookup``) and the draft
(``--spec-type draft-simple``, llama.cpp's default of at most 3 proposals, and each ``--draft-tokens``). The prompts
are ``benchmarks.speculative``'s, with the chat template applied the same way. Decode tok/s is llama.cpp's own
(prompt excluded); medians over ``--repeats``. Writes JSON in ``benchmarks.speculative``'s shape (``--out``), which
``benchmarks.tables`` renders.

llama.cpp is not a dependency: build its examples from the source in llama-cpp-python's sdist (docs/speculative.md,
"llama.cpp on the same pair", says how). Measure alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchmarks.speculative import TASKS, mode_label
from exporters.runtime.generator import chat_prompt
from models import qwen_coder
from models.gguf import gguf_checkpoint

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
COUNTS = re.compile(r"n_(drafted|accept)\s+=\s+(\d+)")


def prompt_files(folder: Path) -> dict[str, Path]:
    """Each task's prompt as the text llama.cpp reads (``-f``), the chat template applied as our generator does."""
    beside = gguf_checkpoint(qwen_coder.gguf_file("1.5b")) / "model.pte"  # chat_prompt reads the folder it names
    files = {}
    for task, (prompt, chat) in TASKS.items():
        text = chat_prompt(beside, prompt) if chat else prompt
        files[task] = folder / f"{task}.txt"
        files[task].write_text(text)
    return files


def run(binary: Path, args: list[str]) -> tuple[str, str]:
    proc = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "LLAMA_LOG_COLORS": "0"})
    if proc.returncode != 0:
        raise SystemExit(f"{binary.name} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout, proc.stderr


def one_run(bin_dir: Path, mode: tuple[str, int | None], prompt: Path, tokens: int, threads: int
            ) -> tuple[float, dict[str, int], str]:
    """tok/s, the counts (n_drafted, n_accept and n_decoded) and the text of one greedy generation."""
    target, draft = qwen_coder.gguf_file("1.5b"), qwen_coder.gguf_file("0.5b")
    common = ["-m", str(target), "-f", str(prompt), "-n", str(tokens), "--temp", "0", "--ignore-eos", "-c", "1024",
              "-t", str(threads)]
    kind, k = mode
    if kind == "none":
        out, err = run(bin_dir / "llama-completion", [*common, "-no-cnv"])
        ms, runs = EVAL.search(err).groups()
        return int(runs) / (float(ms) / 1000), {}, out.strip()
    spec = (["--spec-type", "ngram-simple"] if kind == "lookup"
            else ["--spec-type", "draft-simple", "-md", str(draft)])
    out, err = run(bin_dir / "llama-speculative-simple",
                   [*common, *spec, *(["--spec-draft-n-max", str(k)] if k else [])])
    n, seconds = DECODED.search(err).groups()
    counts = {"decoded": int(n), **{name: int(v) for name, v in COUNTS.findall(err)}}
    return int(n) / float(seconds), counts, out.strip()


SPECIAL = re.compile(r"<\|[^|]*\|>")


def same_text(a: str, b: str) -> bool:
    """The two generations agree over the shorter one (llama.cpp's speculative run may stop a few tokens later;
    its two tools print the prompt's special tokens differently)."""
    a, b = SPECIAL.sub("", a).strip(), SPECIAL.sub("", b).strip()
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def measure(bin_dir: Path, tokens: int, repeats: int, fixed: tuple[int, ...], threads: int) -> dict:
    modes = {"none": ("none", None), "lookup": ("lookup", None), "draft": ("draft", None),
             **{mode_label("draft", k): ("draft", k) for k in fixed}}
    found: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task, prompt in prompt_files(Path(tmp)).items():
            rates: dict[str, list[float]] = {m: [] for m in modes}
            counts, texts = {}, {}
            for r in range(repeats):
                for mode in list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]:
                    rate, counts[mode], texts[mode] = one_run(bin_dir, modes[mode], prompt, tokens, threads)
                    rates[mode].append(rate)
            plain = statistics.median(rates["none"])
            found[task] = {}
            for mode in modes:
                rate, c = statistics.median(rates[mode]), counts[mode]
                calls = c["decoded"] - c["accept"] if c else None
                found[task][mode] = {"tok_s": round(rate, 1), "speedup": round(rate / plain, 2),
                                     "acceptance": round(c["accept"] / max(c["drafted"], 1), 3) if c else None,
                                     "tokens_per_call": round(c["decoded"] / calls, 2) if c else 1.0,
                                     "identical": same_text(texts[mode], texts["none"])}
            print(f"{task}: {found[task]}", flush=True)
    return found


def version(bin_dir: Path) -> str:
    proc = subprocess.run([str(bin_dir / "llama-completion"), "--version"], capture_output=True, text=True)
    return (proc.stdout + proc.stderr).strip().splitlines()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin", type=Path, required=True, help="llama.cpp's build/bin (llama-completion, "
                                                                "llama-speculative-simple)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--draft-tokens", default="", help="fixed most proposals per call beside llama.cpp's "
                                                          "default, comma-separated")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for tool in ("llama-completion", "llama-speculative-simple"):
        if not (args.bin / tool).exists():
            raise SystemExit(f"--bin {args.bin}: no {tool} there. Build llama.cpp's examples first "
                             "(docs/speculative.md, 'llama.cpp on the same pair').")
    fixed = tuple(int(k) for k in args.draft_tokens.split(",") if k)
    found = measure(args.bin, args.tokens, args.repeats, fixed, args.threads)
    report = {"runtime": f"llama.cpp ({version(args.bin)}), {args.threads} threads, the GGUF files as they are",
              "tokens": args.tokens, "tasks": found}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
