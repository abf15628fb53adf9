"""What proposing tokens costs against the model's own calls, in the ExecuTorch runtime, and the acceptance a real
proposer must reach to pay for it.

    python -m benchmarks.proposal_cost <run folder or .pte> [--prompt 64] [--repeats 10] [--out F]

On one loaded program holding a proposer (Gemma 4's assistant, ``draft_propose``; or a draft model, its
``draft_decode_one_token`` called once per proposal), after a prompt of ``--prompt`` tokens: the median
milliseconds of one call of the decoder's step method (one token), one ``verify`` call of K + 1 tokens (and of
n + 1 for every n below K) and one round of K proposals (K = the program's ``get_draft_tokens``: verify's tokens but one). With random weights acceptance means nothing, so
the report gives the break-even instead: if each proposal is kept with probability a (independently), a round of
K proposals and one verify call yields (1 - a^(K+1)) / (1 - a) tokens; speculation pays when that per round's
milliseconds beats one token per step call. ``break_even_acceptance`` is the a where they are equal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.vision import median_seconds
from exporters.program.draft import ASSISTANT_METHOD, DRAFT
from exporters.runtime.driver import Driver
from exporters.runtime.generator import resolve_program
from exporters.runtime.programs import LoadedProgram


def median_ms(call: Callable[[], Any], repeats: int) -> float:
    """The median of ``repeats`` timed calls after a warm-up (benchmarks.vision's), in milliseconds."""
    return round(1000 * median_seconds(call, repeats), 2)


def tokens_per_round(acceptance: float, k: int) -> float:
    """Tokens one verify call yields after K proposals, each kept with probability ``acceptance``."""
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def break_even(step_ms: float, round_ms: float, k: int) -> float | None:
    """The acceptance at which a round (K proposals and one verify) makes tokens as fast as the step method; None
    when even keeping every proposal does not pay."""
    need = round_ms / step_ms  # tokens a round must yield
    if tokens_per_round(1.0, k) < need:
        return None
    low, high = 0.0, 1.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_round(mid, k) < need else (low, mid)
    return round(high, 3)


def measure(program: str, prompt: int, repeats: int) -> dict[str, Any]:
    pte = resolve_program(program)
    loaded = LoadedProgram(pte)
    names = set(loaded.method_names)
    driver = Driver.of(loaded)
    driver.load()
    assert driver.roles.verify is not None, f"{pte} has no verify method: export it with draft.checkpoint=..."
    k = driver.roles.verify_tokens - 1  # the program's get_draft_tokens
    vocab = int(loaded.constant("get_vocab_size"))
    ids = torch.randint(3, min(vocab, 1000), (1, prompt), generator=torch.Generator().manual_seed(0))
    driver.prefill(ids, 0)
    token, at = ids[:, -1:], prompt - 1  # the calls below write position ``at`` again and again
    step_ms = median_ms(lambda: driver.decode_one_token(token, at), repeats)
    verify_by_k = {n: median_ms(lambda n=n: driver.verify([int(token)] * (n + 1), at), repeats)
                   for n in range(max(1, driver.roles.verify_min_tokens - 1), k + 1)}
    verify_ms = verify_by_k[k]
    if ASSISTANT_METHOD in names:
        proposer = "assistant"
        propose_ms = median_ms(lambda: loaded.run(ASSISTANT_METHOD, token, torch.tensor([at])), repeats)
    else:
        proposer = "draft model"
        draft = Driver.of(loaded, DRAFT)
        draft.load()
        draft.prefill(ids, 0)
        propose_ms = median_ms(lambda: [draft.decode_one_token(token, at) for _ in range(k)], repeats)
    round_ms = verify_ms + propose_ms
    return {"program": str(pte), "proposer": proposer, "draft_tokens": k, "prompt_tokens": prompt,
            "step_ms": step_ms, "verify_ms": verify_ms, "propose_ms": propose_ms,
            "propose_ms_per_token": round(propose_ms / k, 2), "round_ms": round(round_ms, 2),
            "verify_over_step": round(verify_ms / step_ms, 2), "propose_over_step": round(propose_ms / step_ms, 2),
            "break_even_acceptance": break_even(step_ms, round_ms, k),
            "speedup_if_all_kept": round((k + 1) * step_ms / round_ms, 2),
            # Fewer proposals used per round (the method still proposes K; a draft model would stop early): each
            # n's verify call, the round's break-even and its speed-up if every proposal were kept.
            "by_proposals": {n: {"verify_ms": v, "break_even_acceptance": break_even(step_ms, v + propose_ms, n),
                                 "speedup_if_all_kept": round((n + 1) * step_ms / (v + propose_ms), 2)}
                             for n, v in verify_by_k.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program", help="a run folder or .pte with verify and a proposer")
    parser.add_argument("--prompt", type=int, default=64, help="tokens in the cache before the timed calls")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    found = measure(args.program, args.prompt, args.repeats)
    print(json.dumps(found, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
