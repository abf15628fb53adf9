"""Tables in the README and docs that come from measurements, written from the tools' JSON output, never retyped.

A generated region in a Markdown file looks like this (the JSON path is relative to the top of the checkout):

    <!-- generated: suite docs/results/suite.json -->
    ...the table...
    <!-- end generated -->

    python -m benchmarks.tables            rewrite every region of README.md and docs/*.md from its JSON
    python -m benchmarks.tables --check    exit 1 naming each region that differs (tests/test_docs_tables.py runs it)

Each renderer takes one tool's JSON: ``suite`` the test suite's durations (``pytest --durations-file PATH``),
``export`` a ``benchmarks.export`` report (``report.json``), ``speculative`` a ``benchmarks.speculative`` or
``benchmarks.llama_cpp`` report, ``memory`` a ``benchmarks.memory_estimate`` report, ``hybrid`` the rows
``benchmarks.hybrid --results`` keeps, ``adapters`` a ``benchmarks.adapters`` report, ``vision_quant`` the rows
``benchmarks.vision_quant --results`` writes, ``serve`` a ``benchmarks.serve`` report, ``speech`` a
``benchmarks.speech`` report, ``audio_shape`` a ``benchmarks.audio_language`` report, ``audio_peer`` a
``benchmarks.executorch_gemma4`` report, ``vision_shape`` a
``benchmarks.vision --report`` report. Keep the JSON files in
``docs/results/``: they are the measurement, the table is a view of it. A new table is a renderer in
:data:`RENDERERS` and a region in a doc.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
REGION = re.compile(r"(<!-- generated: (?P<kind>\w+) (?P<source>\S+) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                    re.DOTALL)


def render_suite(data: dict[str, Any]) -> str:
    """The suite's time per test file, slowest first, with the run's wall time and what it ran."""
    files = sorted(data["files"].items(), key=lambda kv: -kv[1]["seconds"])
    busy = sum(f["seconds"] for _, f in files)
    outcomes = ", ".join(f"{n} {k}" for k, n in data["outcomes"].items())
    lines = [f"Wall time {data['wall_s'] / 60:.1f} min on {data['workers']} workers ({outcomes}; markers "
             f"`{data['markers'] or 'none'}`); the files' own time adds up to {busy / 60:.1f} min of worker time.", "",
             "| test file | tests | seconds | share |", "|---|---|---|---|"]
    lines += [f"| `{name}` | {f['tests']} | {f['seconds']:.0f} | {f['seconds'] / busy:.0%} |" for name, f in files]
    return "\n".join(lines) + "\n"


def render_export(data: dict[str, Any]) -> str:
    """A ``benchmarks.export`` report: each exporter's export and runtime numbers, and ours over export_llm's."""
    results: dict[str, dict[str, Any]] = data["results"]
    real = any("perplexity" in r for r in results.values())
    lines = [f"{data['preset']} ({data['parameters'] / 1e6:.1f}M parameters), xnnpack {data['quant']} "
             f"g{data['group_size']}, max_seq_len {data['max_seq_len']}", "",
             "| exporter | export wall s | peak RSS GB | program MB | decode tok/s | prefill tok/s |"
             + (" perplexity |" if real else ""), "|---|---|---|---|---|---|" + ("---|" if real else "")]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed after {r['wall_s']} s: {r['failed']} | {r['peak_rss_gb']} | | | |"
                         + (" |" if real else ""))
            continue
        lines.append(f"| {name} | {r['wall_s']} | {r['peak_rss_gb']} | {r['pte_mb']} | {r.get('decode_tok_s', '—')} | "
                     f"{r.get('prefill_tok_s', '—')} |" + (f" {r.get('perplexity', '—')} |" if real else ""))
    ratios = data.get("ours_over_export_llm") or {}
    if ratios:
        lines.append("| ours / export_llm | " + " | ".join(str(ratios.get(k, "—")) for k in
                     ("wall_s", "peak_rss_gb", "pte_mb", "decode_tok_s", "prefill_tok_s")) + " |"
                     + (" |" if real else ""))
    return "\n".join(lines) + "\n"


def render_speculative(data: dict[str, Any]) -> str:
    """A ``benchmarks.speculative`` (or ``benchmarks.llama_cpp``) report: each task's decode speed per mode,
    proposals kept, tokens per call."""
    rss = data.get("rss_after_load")
    where = (f"RSS after load {rss['plain_mb']:.0f} MB with the plain methods, {rss['speculative_mb']:.0f} MB with "
             "verify and the draft's too." if rss else f"{data['runtime']}.")
    lines = [f"{data['tokens']} greedy tokens per run, medians of the repeats; {where}", "",
             "| task | mode | tok/s | speedup | proposals kept | tokens per target call | same tokens as none |",
             "|---|---|---|---|---|---|---|"]
    for task, modes in data["tasks"].items():
        for mode, r in modes.items():
            kept = "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            lines.append(f"| {task} | {mode} | {r['tok_s']} | {r['speedup']}x | {kept} | {r['tokens_per_call']} | "
                         f"{'yes' if r['identical'] else 'no'} |")
    return "\n".join(lines) + "\n"


def render_memory(data: dict[str, Any]) -> str:
    """A ``benchmarks.memory_estimate`` report: each export's measured peak RSS beside the load stage's estimate."""
    lines = [f"Each export as the CLI runs it (validation on; advise where the quality warning set it off). The "
             f"estimate must hold the measured peak within {data['tolerance']:.0%} (`tests/test_footprint.py`). "
             "`first-load`: from the GGUF file itself with an empty cache (its conversion is part of the export); "
             "`draft=`: that model's GGUF as the draft, converted too.", "",
             "| preset | quant | measured peak MB | in stage | estimated MB | in stage | error |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        quant = r["run"].removeprefix(f"{r['preset']} ")
        lines.append(f"| {r['preset']} | {quant} | {r['peak_mb']} | {r['peak_stage']} | {r['estimated_mb']:.0f} | "
                     f"{r['estimated_stage']} | {r['error']:+.1%} |")
    return "\n".join(lines) + "\n"


def render_hybrid(data: dict[str, Any]) -> str:
    """``benchmarks.hybrid`` rows: each shape's export cost and its decode speed early and late in the context."""
    lines = ["| model (random weights) | quant | export s | peak RSS GB | .pte MB | KV cache MB | recurrent state MB | "
             "RSS after load MB | prefill tok/s (64) | decode tok/s at 64 | decode tok/s at context - 32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        late = next(v for k, v in r.items() if k.startswith("decode_at_") and k != "decode_at_64_tok_s")
        lines.append(f"| {r['preset']} ({r['parameters_m']}M) | {r['quant']} | {r['export_s']} | {r['peak_rss_gb']} | "
                     f"{r['pte_mb']} | {r['kv_cache_mb']} | {r['state_mb']} | {r['rss_after_load_mb']} | "
                     f"{r['prefill_64_tok_s']} | {r['decode_at_64_tok_s']} | {late} (at {r['context'] - 32}) |")
    return "\n".join(lines) + "\n"


def render_adapters(data: dict[str, Any]) -> str:
    """A ``benchmarks.adapters`` report: each export.adapters mode's rows and its time to swap."""
    from benchmarks.adapters import modes_md

    return "\n".join(modes_md(data)).rstrip("\n") + "\n"


def render_vision_quant(data: Any) -> str:
    """``benchmarks.vision_quant`` rows: each shape's image embeddings under each quant.vision scheme against fp32."""
    lines = ["| shape (random weights) | `quant.vision` | least cosine, uniform image | least cosine, smooth image | "
             "relative error (smooth) |", "|---|---|---|---|---|"]
    for shape in data:
        for row in shape["schemes"]:
            if row["scheme"] == "fp32":
                continue
            lines.append(f"| {shape['shape']} ({shape['encoder_params_m']}M, {shape['image_size']} px) | "
                         f"`{row['scheme']}` | {row['uniform']['least_cosine']:.4f} | {row['smooth']['least_cosine']:.4f} "
                         f"| {row['smooth']['relative_error']:.1%} |")
    return "\n".join(lines) + "\n"


def render_serve(data: dict[str, Any]) -> str:
    """A ``benchmarks.serve`` report: what the server adds to a request, and what the cache across turns saves."""
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| a short completion's time to first token: server / the program's own prefill | "
        f"{data['short_prompt_ttft_s'] * 1000:.1f} ms / {data['short_prompt_prefill_s'] * 1000:.1f} ms "
        f"(overhead {data['overhead_ms']:+.1f} ms) |",
        f"| a chat's first turn ({data['prompt_tokens']} prompt tokens): time to first token | "
        f"{data['first_turn_ttft_s']:.3f} s (the program's prefill: {data['prefill_s']:.3f} s) |",
        f"| its second turn: time to first token | {data['second_turn_ttft_s']:.3f} s "
        f"({data['second_over_first']:.3f}x the first's) |",
        f"| greedy answers token for token those of `exporters.generate` | "
        f"{'yes' if data['greedy_as_generate'] else 'NO'} |",
        "", f"Medians of {data['repeats']} runs."]) + "\n"


def render_speech(data: dict[str, Any]) -> str:
    """A ``benchmarks.speech`` report: each precision's export, size, transcripts and speed on real Whisper."""
    lines = [f"{data['checkpoint']}; {data['sentences']} sentences espeak-ng speaks, and "
             f"{data['long_recording_s']:.1f} s of them joined (one window) for the speed columns.", "",
             "| program | export s | peak RSS MB | program MB | RSS after load MB | tokens as transformers' greedy | "
             "WER vs text | WER vs fp32 | encoder s | decode tok/s | real-time factor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in data["programs"].items():
        q, long = p["quantization"], p["long"]
        lines.append(f"| {name} (encoder {q['encoder'].split(' ')[0]}, decoder {q['decoder']}) | {p['export_s']:.0f} | "
                     f"{p['peak_rss_mb']} | {p['program_mb']:.1f} | {p['rss_after_load_mb']} | "
                     f"{p['identical_to_transformers']}/{data['sentences']} | {100 * p['wer_vs_text']:.1f}% | "
                     f"{100 * p.get('wer_vs_fp32', 0):.1f}% | {long['encode_s']:.2f} | {long['tokens_per_s']:.1f} | "
                     f"{long['real_time_factor']:.3f} |")
    for name, p in data.get("peers", {}).items():  # another exporter's program of the same checkpoint, our loop
        if "failed" in p:
            lines.append(f"| {name} | failed after {p['export_s']:.0f} s: {p['failed']} | {p['peak_rss_mb']} |"
                         + " |" * 8)
            continue
        long = p["long"]
        lines.append(f"| {name} | {p['export_s']:.0f} | {p['peak_rss_mb']} | {p['program_mb']:.1f} | "
                     f"{p['rss_after_load_mb']} | {p['identical_to_transformers']}/{data['sentences']} | "
                     f"{100 * p['wer_vs_text']:.1f}% | {100 * p.get('wer_vs_fp32', 0):.1f}% | {long['encode_s']:.2f} | "
                     f"{long['tokens_per_s']:.1f} | {long['real_time_factor']:.3f} |")
    return "\n".join(lines) + "\n"


def render_audio_shape(data: dict[str, Any]) -> str:
    """A ``benchmarks.audio_language`` report: one published shape's export cost and its audio path's speed."""
    r, stages = data["runtime"], data["stages_s"]
    settings = " ".join(o for o in data["overrides"] if not o.startswith(("model=", "model.checkpoint=")))
    return "\n".join([
        f"{data['shape']}, `{settings}`:", "",
        "| export s | peak RSS MB | estimated MB | program MB | RSS after load MB | audio_encoder, 30 s | "
        "prompt with audio | decode |", "|---|---|---|---|---|---|---|---|",
        f"| {data['wall_s']:.0f} | {data['peak_rss_mb']} | {data['estimated_peak_rss_mb']:.0f} | "
        f"{data['program_mb']:.1f} | {r['rss_after_load_mb']:.0f} | {r['audio_encode_ms_30s'] / 1e3:.1f} s | "
        f"{r['prompt_tokens']} tokens at {r['prompt_with_audio_tok_s']} tok/s | {r['decode_tok_s']} tok/s |", "",
        "Stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()) + "."]) + "\n"


def render_audio_peer(data: dict[str, Any]) -> str:
    """A ``benchmarks.executorch_gemma4`` report: ExecuTorch's own Gemma 4 export of the shape, whole and (where the
    whole one fails) its audio tower alone, beside our program's audio path measured in the same run."""
    def export(r: dict[str, Any]) -> str:
        return f"{r['wall_s']:.0f} s, peak {r['peak_rss_mb']} MB" + (f": **{r['failed']}**" if r["failed"] else "")

    def encode(r: dict[str, Any] | None) -> str:
        return f"{r['audio_encode_ms_30s'] / 1e3:.2f} s ({r['audio_positions']} positions)" if r else "-"

    ours, alone = data.get("ours"), data.get("audio_only")
    rows = [f"| ExecuTorch's `export_gemma4.py`, whole (`{' '.join(data['flags'])}`, max_seq_len {data['max_seq_len']}) "
            f"| {export(data)} | {data.get('program_mb', '-')} | {encode(data.get('runtime'))} | "
            f"{(data.get('runtime') or {}).get('audio_partitions', '-')} |"]
    if alone:
        rows.append(f"| the same exporter's steps for `speech_transform` + `audio_encoder` alone | {export(alone)} | "
                    f"{alone.get('program_mb', '-')} | {encode(alone.get('runtime'))} | "
                    f"{(alone.get('runtime') or {}).get('audio_partitions', '-')} |")
    if ours:
        rows.append(f"| ours (whole program, above) | see above | {ours['program_mb']} | {encode(ours['runtime'])} | "
                    f"{ours['audio_partitions']} |")
    return "\n".join(["| export | export wall, peak RSS | program MB | audio_encoder, 30 s | XNNPACK partitions |",
                      "|---|---|---|---|---|", *rows]) + "\n"


def render_vision_shape(data: dict[str, Any]) -> str:
    """A ``benchmarks.vision --report`` report: one published shape's export cost and its image path's speed."""
    r, stages = data["runtime"], data["stages_s"]
    return "\n".join([
        f"{data['shape']} (random weights), `{' '.join(data['settings'])}`:", "",
        "| export s | peak RSS MB | estimated MB | program MB | RSS after load MB | vision_encoder, one image | "
        "prompt with the image | decode |", "|---|---|---|---|---|---|---|---|",
        f"| {data['wall_s']:.0f} | {data['peak_rss_mb']} | {data['estimated_peak_rss_mb']:.0f} | "
        f"{data['program_mb']:.1f} | {r['rss_after_load_mb']:.0f} | {r['image_encode_ms'] / 1e3:.1f} s "
        f"({r['image_size']} px, {r['image_positions']} positions) | {r['prompt_tokens']} tokens at "
        f"{r['prompt_with_image_tok_s']} tok/s | {r['decode_tok_s']} tok/s |", "",
        "Stages (s): " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()) + ". Delegated partitions: "
        + ", ".join(f"`{k}` {v}" for k, v in data["partitions"].items()) + "."]) + "\n"


def render_grammar_engines(data: dict[str, Any]) -> str:
    """A ``benchmarks.grammar_engines`` report: each engine's cost on one tokenizer and the 20 schemas."""
    lines = [f"{data['schemas']} schemas, the {data['tokenizer']} tokenizer ({data['vocab']} tokens):", "",
             "| engine | tokenizer prepared | compile per schema (median / max) | the engine's mask per token (median / "
             "mean) | mask, apply and consume per token (median / p99 / mean) | examples accepted |",
             "|---|---|---|---|---|---|"]
    for name, e in data["engines"].items():
        if "missing" in e:
            lines.append(f"| {name} | not installed: {e['missing']} | | | | |")
            continue
        lines.append(f"| {name} {e.get('version', '')} | {e['prepare_s']:.2f} s | {e['compile_ms_median']:.1f} / "
                     f"{e['compile_ms_max']:.1f} ms | {e['fill_us_median']:.0f} / {e['fill_us_mean']:.0f} µs | "
                     f"{e['mask_us_median']:.0f} / {e['mask_us_p99']:.0f} / "
                     f"{e['mask_us_mean']:.0f} µs | {e['examples_accepted']}/{e['examples']} |")
    return "\n".join(lines) + "\n"


def render_constrained(data: dict[str, Any]) -> str:
    """A ``benchmarks.constrained`` report: valid answers and the grammar's cost in decode speed."""
    s = data["summary"]
    return "\n".join([
        "| measure | value |", "|---|---|",
        f"| answers that parse and validate | {s['valid']}/{s['schemas']} ({s['ended']} ended by themselves within "
        f"{data['max_tokens']} tokens) |",
        f"| decode tokens/s, constrained / unconstrained | {s['tok_s']:.1f} / {s['plain_tok_s']:.1f} "
        f"({s['ratio']:.2f}x) |",
        f"| the engine's tokenizer, made once per program | {s['engine_tokenizer_s']:.2f} s |"]) + "\n"


def render_serve_peers(data: dict[str, Any]) -> str:
    """A ``benchmarks.serve_peers`` report: each server's time to first token and decode rates by concurrent clients."""
    lines = ["| server | clients | time to first token (median) | one request's decode tok/s (median) | "
             "all clients' tok/s |", "|---|---|---|---|---|"]
    names = {"ours": f"ours ({data['program']}, {data['quantization']})", "llama-server": f"llama-server ({data['gguf']})"}
    for server, by_clients in data["servers"].items():
        for clients, r in by_clients.items():
            lines.append(f"| {names.get(server, server)} | {clients} | {r['ttft_s'] * 1000:.0f} ms | "
                         f"{r['decode_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} |")
    return "\n".join(lines + ["", f"{data['max_tokens']} tokens a request, greedy, streamed; medians of "
                                   f"{data['repeats']} rounds."]) + "\n"


RENDERERS: dict[str, Callable[[Any], str]] = {"serve": render_serve, "suite": render_suite, "export": render_export,
                                              "speculative": render_speculative, "memory": render_memory,
                                              "hybrid": render_hybrid, "adapters": render_adapters,
                                              "vision_quant": render_vision_quant, "speech": render_speech,
                                              "audio_shape": render_audio_shape, "audio_peer": render_audio_peer,
                                              "vision_shape": render_vision_shape,
                                              "grammar_engines": render_grammar_engines,
                                              "constrained": render_constrained, "serve_peers": render_serve_peers}


def regenerate(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """``text`` with every generated region rendered from its JSON, and the regions that changed."""
    changed: list[str] = []

    def fill(match: re.Match[str]) -> str:
        kind, source = match["kind"], match["source"]
        if kind not in RENDERERS:
            raise SystemExit(f"unknown table kind {kind!r} (known: {', '.join(RENDERERS)})")
        body = RENDERERS[kind](json.loads((root / source).read_text()))
        if body != match["body"]:
            changed.append(f"{kind} from {source}")
        return match.group(1) + body + match.group(5)

    return REGION.sub(fill, text), changed


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a region is stale")
    args = parser.parse_args()
    stale = []
    for doc in documents():
        text = doc.read_text()
        new, changed = regenerate(text)
        stale += [f"{doc.relative_to(ROOT)}: {c}" for c in changed]
        if changed and not args.check:
            doc.write_text(new)
    for line in stale:
        print(("stale: " if args.check else "rewrote: ") + line)
    sys.exit(1 if stale and args.check else 0)


if __name__ == "__main__":
    main()
