"""What a long context costs, with an fp32 and an int8 KV cache (``export.kv_dtype``), on the same model.

    python -m benchmarks.long_context --preset smollm2 --out bench/long_context/smollm2     # real weights: + quality
    python -m benchmarks.long_context --preset 1b --out bench/long_context/1b                # random weights: speed, memory

Exports the preset twice (xnnpack ``--quant``, ``export.max_context_len=--context``, ``export.max_seq_len=--seq``,
validate=false), once per cache dtype, each in a child process (its wall time and peak RSS), then measures both
programs in the same rounds, alternating which goes first:

* bytes per token and for the whole cache (the manifest), and RSS a fresh process gains loading the program;
* decode tok/s at ``--positions``: the cache filled by prefill up to the position, then ``--steps`` greedy steps;
* for real weights, perplexity of ``--text`` (default benchmarks/data/long_text.txt, used by neither calibration
  nor validation) over one window of the whole context, one token per step, and per ``--segment`` tokens: whether
  the int8 cache loses more as the context fills.

With ``--sink K`` it measures generation past the cache instead: one program with ``export.attention_sink=K``
steps through the whole ``--text`` (several caches long), and the same program restarted whenever its cache is
full, re-reading the last half of the cache as a new prompt (what an app without a sink does). Perplexity per
``--segment`` tokens for both, and the last segment's against the first full cache's:

    python -m benchmarks.long_context --preset smollm2 --sink 4 --context 512 --seq 64 --out bench/long_context/sink

Writes ``summary.json`` and ``summary.md`` into ``--out``; ``--reuse`` keeps programs already exported there.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from benchmarks.exporting import exporter_command, run_measured
from benchmarks.presets import add_preset_arguments, preset_of, preset_overrides
from exporters.manifest import Manifest
from exporters.runtime.driver import Driver
from exporters.runtime.memory import memory_after_load_mb
from exporters.runtime.programs import LoadedProgram

DTYPES = ("fp32", "int8")
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "long_text.txt"


def export_program(args: argparse.Namespace, run_dir: Path, extra: list[str]) -> dict:
    """One program exported in a child process (unless ``--reuse`` finds it): where it is, wall s, peak RSS MB."""
    pte = run_dir / "model.pte"
    wall = peak = None
    if not (args.reuse and pte.is_file()):
        overrides = [*preset_overrides(preset_of(args), args.out / "checkpoint"), f"quant={args.quant}",
                     f"export.max_seq_len={args.seq}", f"export.max_context_len={args.context}", *extra,
                     "validate=false", "bench=false", f"export.output_dir={run_dir}"]
        print(f"exporting {' '.join(extra)} ...", flush=True)
        wall, peak = run_measured(exporter_command(overrides, run_dir), run_dir / "export.log")
    return {"pte": pte, "export_s": wall, "export_peak_rss_mb": peak}


def export_both(args: argparse.Namespace, out: Path) -> dict[str, dict]:
    """Each cache dtype's program."""
    return {kv: export_program(args, out / f"kv_{kv}", [f"export.kv_dtype={kv}"]) for kv in DTYPES}


def fill_and_time(driver: Driver, position: int, steps: int, vocab: int, seed: int) -> float:
    """Decode tok/s of ``steps`` greedy steps ending at ``position``, after prefill filled the cache before them."""
    start_pos = position - steps
    tokens = torch.randint(3, vocab, (1, start_pos), generator=torch.Generator().manual_seed(seed))
    logits = driver.prefill(tokens)
    start = time.perf_counter()
    for i in range(steps):
        logits = driver.decode_one_token(int(logits.argmax()), start_pos + i)
    return steps / (time.perf_counter() - start)


def decode_speeds(drivers: dict[str, Driver], positions: list[int], steps: int, repeats: int,
                  vocab: int) -> dict[str, dict[int, float]]:
    """Median decode tok/s per program and position; rounds interleave the programs (round 0 warms up)."""
    rates: dict[str, dict[int, list[float]]] = {kv: {p: [] for p in positions} for kv in drivers}
    for r in range(repeats + 1):
        for kv in (list(drivers) if r % 2 == 0 else list(reversed(drivers))):
            for p in positions:
                rate = fill_and_time(drivers[kv], p, steps, vocab, seed=r)
                if r:
                    rates[kv][p].append(rate)
    return {kv: {p: round(statistics.median(v), 1) for p, v in by_pos.items()} for kv, by_pos in rates.items()}


def text_ids(text_file: Path, pte: Path, length: int) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(pte.parent / "tokenizer.json")).encode(text_file.read_text()).ids
    if len(ids) < length:
        raise SystemExit(f"{text_file} has {len(ids)} tokens; the context is {length}: give a longer --text")
    return ids[:length]


def stepwise_nll(driver: Driver, ids: list[int]) -> list[float]:
    """Negative log-likelihood of each next token, the program stepping one token at a time from position 0."""
    nll = []
    for pos in range(len(ids) - 1):
        logits = driver.decode_one_token(ids[pos], pos).float()
        nll.append(float(-torch.log_softmax(logits[0], -1)[ids[pos + 1]]))
    return nll


def segment_ppl(nll: list[float], segment: int) -> list[float]:
    return [round(math.exp(statistics.fmean(nll[i:i + segment])), 3) for i in range(0, len(nll), segment)]


def restarting_nll(driver: Driver, ids: list[int], context: int) -> list[float]:
    """:func:`stepwise_nll` of a program without a sink: when its cache is full it starts again from position 0
    with the last half of the cache re-read as a prompt (that prompt's own tokens were scored before)."""
    nll, pos, keep = [], 0, context // 2
    for i in range(len(ids) - 1):
        if pos == context:
            driver.prefill(torch.tensor([ids[i - keep:i]]), start=0)
            pos = keep
        logits = driver.decode_one_token(ids[i], pos).float()
        pos += 1
        nll.append(float(-torch.log_softmax(logits[0], -1)[ids[i + 1]]))
    return nll


def sink_run(args: argparse.Namespace) -> None:
    """Perplexity along a text several caches long: with the sink, and restarting the context."""
    run = export_program(args, args.out / f"sink_{args.sink}", [f"export.attention_sink={args.sink}"])
    driver = Driver.of(LoadedProgram(run["pte"]))
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(run["pte"].parent / "tokenizer.json")).encode(args.text.read_text()).ids
    rows = {}
    for label, nll in (("sink", stepwise_nll(driver, ids)), ("restart", restarting_nll(driver, ids, args.context))):
        segments = segment_ppl(nll, args.segment)
        first_full = args.context // args.segment - 1  # the last segment inside the first cache
        rows[label] = {"ppl": round(math.exp(statistics.fmean(nll)), 3), "ppl_by_segment": segments,
                       "last_vs_first_full_cache": round(segments[-1] / segments[first_full], 3),
                       "past_cache_vs_first_cache": round(
                           math.exp(statistics.fmean(nll[args.context:])) / math.exp(statistics.fmean(nll[:args.context])), 3)}
    summary = {"preset": args.preset, "quant": args.quant, "context": args.context, "seq": args.seq,
               "sink": args.sink, "text": str(args.text), "tokens": len(ids), "segment": args.segment, "runs": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"{args.preset}, xnnpack {args.quant}, context {args.context}, sink {args.sink}, {len(ids)} tokens of "
             f"{args.text.name} ({len(ids) / args.context:.1f} caches), perplexity per {args.segment} tokens", "",
             "| run | ppl | past the first cache / within it | last segment / last of the first cache | segments |",
             "|---|---|---|---|---|"]
    lines += [f"| {label} | {r['ppl']} | {r['past_cache_vs_first_cache']} | {r['last_vs_first_full_cache']} | "
              f"{' '.join(str(x) for x in r['ppl_by_segment'])} |" for label, r in rows.items()]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_preset_arguments(parser, default="smollm2")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quant", default="8da4w")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256, help="export.max_seq_len: tokens per prefill call")
    parser.add_argument("--positions", type=int, nargs="+", default=[64, 1024, 2048])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--segment", type=int, default=256)
    parser.add_argument("--reuse", action="store_true", help="keep programs already exported in --out")
    parser.add_argument("--sink", type=int, default=0, help="measure generation past the cache with this sink")
    args = parser.parse_args()
    preset = preset_of(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.sink:
        return sink_run(args)
    runs = export_both(args, args.out)
    programs = {kv: LoadedProgram(run["pte"]) for kv, run in runs.items()}
    drivers = {kv: Driver.of(p) for kv, p in programs.items()}
    vocab = int(programs["fp32"].constant("get_vocab_size"))
    rows = {}
    for kv, run in runs.items():
        m = Manifest.read(run["pte"].parent / "manifest.json")
        assert m.kv_cache is not None
        d = drivers[kv]
        rss, _ = memory_after_load_mb(run["pte"], [d.roles.prompt, d.roles.step])
        rows[kv] = {"pte_mb": round(m.program.size_bytes / 1e6, 1), "kv_bytes_per_token": m.kv_cache.bytes_per_token,
                    "kv_mb": round(m.kv_cache.bytes / 1e6, 1), "rss_after_load_mb": round(rss),
                    "export_s": None if run["export_s"] is None else round(run["export_s"]),
                    "export_peak_rss_mb": None if run["export_peak_rss_mb"] is None else round(run["export_peak_rss_mb"])}
    print("measuring decode speed ...", flush=True)
    speeds = decode_speeds(drivers, [min(p, args.context) for p in args.positions], args.steps, args.repeats, vocab)
    for kv in runs:
        rows[kv]["decode_tok_s"] = speeds[kv]
    if preset.real:
        print("measuring perplexity on the long text ...", flush=True)
        ids = text_ids(args.text, runs["fp32"]["pte"], args.context)
        for kv in runs:
            nll = stepwise_nll(drivers[kv], ids)
            rows[kv]["ppl"] = round(math.exp(statistics.fmean(nll)), 3)
            rows[kv]["ppl_by_segment"] = segment_ppl(nll, args.segment)
    summary = {"preset": args.preset, "quant": args.quant, "context": args.context, "seq": args.seq,
               "text": str(args.text) if preset.real else None, "programs": rows}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))


def markdown(s: dict) -> str:
    rows, fp32 = s["programs"], s["programs"]["fp32"]
    positions = list(fp32["decode_tok_s"])
    head = ("| kv cache | KV bytes/token | KV MB | .pte MB | RSS after load MB | "
            + " | ".join(f"decode tok/s @{p}" for p in positions) + (" | ppl |" if "ppl" in fp32 else " |"))
    lines = [f"{s['preset']}, xnnpack {s['quant']}, context {s['context']}, {s['seq']} tokens per call", "", head,
             "|" + "---|" * (5 + len(positions) + ("ppl" in fp32))]
    for kv, r in rows.items():
        ratio = "" if kv == "fp32" else f" ({r['kv_bytes_per_token'] / fp32['kv_bytes_per_token']:.2f}x)"
        speeds = " | ".join(f"{r['decode_tok_s'][p]}" + ("" if kv == "fp32" else
                                                          f" ({r['decode_tok_s'][p] / fp32['decode_tok_s'][p]:.2f}x)")
                            for p in positions)
        ppl = "" if "ppl" not in r else f" {r['ppl']}" + ("" if kv == "fp32" else f" ({r['ppl'] / fp32['ppl'] - 1:+.2%})")
        lines.append(f"| {kv} | {r['kv_bytes_per_token']}{ratio} | {r['kv_mb']} | {r['pte_mb']} | "
                     f"{r['rss_after_load_mb']} | {speeds} |{ppl}" + (" |" if ppl else ""))
    if "ppl_by_segment" in fp32:
        lines += ["", f"perplexity per {len(fp32['ppl_by_segment'])} segments of the window: "
                  + "; ".join(f"{kv} {r['ppl_by_segment']}" for kv, r in rows.items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
