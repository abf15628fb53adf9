"""Where an export's time goes: inclusive share of samples per function in a py-spy profile.

    python -m benchmarks.pyspy_summary --preset 134m --out prof/134m    # record an export of the preset, then summarize
    python -m benchmarks.pyspy_summary export.json                      # the 40 most inclusive functions
    python -m benchmarks.pyspy_summary export.json --within LowerStage.run \\
        --inside _choose_qparams_affine,_quantize_affine,_dequantize_affine

``--preset`` runs ``py-spy record --rate 20 --format speedscope -o <out>/export.json -- python -m exporters.llm ...``
on that preset (xnnpack ``--quant``, validate=false; py-spy: ``pip install py-spy``), any other profile comes
from the same command. ``--within F --inside G,H``: of the samples under ``F``, the share that is also under
``G`` or ``H`` (e.g. how much of lowering re-runs torchao's quantization primitives).
"""

from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.exporting import exporter_command
from benchmarks.presets import add_preset_arguments, preset_of, preset_overrides

REPO = Path(__file__).resolve().parent.parent


def frame_label(frame: dict) -> str:
    return f"{frame['name']} ({frame.get('file', '').split('site-packages/')[-1]})"


def record(cmd: list[str], profile: Path, rate: int) -> None:
    """Run ``cmd`` under ``py-spy record`` into a speedscope ``profile``."""
    beside = Path(sys.executable).parent / "py-spy"  # installed in this venv, which need not be on PATH
    pyspy = str(beside) if beside.is_file() else shutil.which("py-spy")
    if pyspy is None:
        raise SystemExit("py-spy is not installed (pip install py-spy): it records the profile --preset asks for.")
    proc = subprocess.run([pyspy, "record", "--rate", str(rate), "--format", "speedscope", "-o", str(profile), "--",
                           *cmd], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0 or not profile.is_file():
        raise SystemExit(f"py-spy record failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def summarize(profile: Path, top: int, within: str | None = None, inside: str | None = None) -> list[str]:
    """The summary's lines: the ``top`` most inclusive functions, or ``within``'s share under ``inside``."""
    if not profile.is_file():
        raise SystemExit(f"{profile}: no such file (a py-spy --format speedscope profile).")
    data = json.loads(profile.read_text())
    frames = data["shared"]["frames"]
    samples = [stack for p in data["profiles"] for stack in p["samples"]]
    if not samples:
        raise SystemExit(f"{profile} holds no samples: the recorded process ended before py-spy sampled it.")
    if within:
        stacks = [{frames[i]["name"] for i in stack} for stack in samples]
        under = [names for names in stacks if within in names]
        wanted = set(inside.split(",")) if inside else set()
        hits = sum(1 for names in under if names & wanted)
        return [f"{within}: {100 * len(under) / len(stacks):.1f}% of all samples; "
                f"{100 * hits / max(1, len(under)):.0f}% of them under {', '.join(sorted(wanted)) or '-'}"]
    inclusive: collections.Counter[str] = collections.Counter()
    for stack in samples:
        inclusive.update({frame_label(frames[i]) for i in stack})
    return [f"{len(samples)} samples"] + [f"{100 * count / len(samples):5.1f}%  {label}"
                                           for label, count in inclusive.most_common(top)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, nargs="?", help="py-spy --format speedscope output")
    add_preset_arguments(parser, default=None)
    parser.add_argument("--quant", default="8da4w", help="quant option of the --preset export (conf/quant)")
    parser.add_argument("--max-seq-len", type=int, default=256, help="context of the --preset export")
    parser.add_argument("--rate", type=int, default=20, help="py-spy samples per second (--preset)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the --preset export and its profile")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--within", help="a function name: restrict to samples under it")
    parser.add_argument("--inside", help="comma-separated function names: share of --within's samples under them")
    args = parser.parse_args()
    if (args.profile is None) == (args.preset is None):
        parser.error("give either a profile (py-spy speedscope JSON) or --preset NAME to record one")
    profile = args.profile
    if profile is None:
        out = (args.out or Path(tempfile.mkdtemp(prefix="pyspy_"))).resolve()
        out.mkdir(parents=True, exist_ok=True)
        overrides = [*preset_overrides(preset_of(args), out), f"quant={args.quant}",
                     f"export.max_seq_len={args.max_seq_len}", "validate=false", "bench=false"]
        profile = out / "export.json"
        print(f"recording an export of {args.preset} with py-spy into {profile} ...", flush=True)
        record(exporter_command(overrides, out / "export"), profile, args.rate)
    print("\n".join(summarize(profile, args.top, args.within, args.inside)))


if __name__ == "__main__":
    main()
