"""Where an export's time goes: inclusive share of samples per function in a py-spy profile.

    py-spy record --rate 20 --format speedscope -o export.json -- python -m exporters.llm ...
    python scripts/pyspy_summary.py export.json                   # the 40 most inclusive functions
    python scripts/pyspy_summary.py export.json --within LowerStage.run \\
        --inside _choose_qparams_affine,_quantize_affine,_dequantize_affine

``--within F --inside G,H``: of the samples under ``F``, the share that is also under ``G`` or ``H``
(e.g. how much of lowering re-runs torchao's quantization primitives).
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path


def frame_label(frame: dict) -> str:
    return f"{frame['name']} ({frame.get('file', '').split('site-packages/')[-1]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", type=Path, help="py-spy --format speedscope output")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--within", help="a function name: restrict to samples under it")
    parser.add_argument("--inside", help="comma-separated function names: share of --within's samples under them")
    args = parser.parse_args()
    data = json.loads(args.profile.read_text())
    frames = data["shared"]["frames"]
    samples = [stack for profile in data["profiles"] for stack in profile["samples"]]
    stacks = [{frames[i]["name"] for i in stack} for stack in samples]
    if args.within:
        under = [names for names in stacks if args.within in names]
        inside = set(args.inside.split(",")) if args.inside else set()
        hits = sum(1 for names in under if names & inside)
        print(f"{args.within}: {100 * len(under) / len(stacks):.1f}% of all samples; "
              f"{100 * hits / max(1, len(under)):.0f}% of them under {', '.join(sorted(inside)) or '-'}")
        return
    inclusive: collections.Counter[str] = collections.Counter()
    for stack in samples:
        inclusive.update({frame_label(frames[i]) for i in stack})
    print(f"{len(samples)} samples")
    for label, count in inclusive.most_common(args.top):
        print(f"{100 * count / len(samples):5.1f}%  {label}")


if __name__ == "__main__":
    main()
