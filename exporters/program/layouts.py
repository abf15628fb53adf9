"""Method layouts, and what ExecuTorch's stock LLM runners make of them.

ExecuTorch's ``TextLLMRunner`` picks its methods by name (``create_text_llm_runner`` in
``extension/llm/runner/llm_runner_helper.cpp``) and loads them through a ``Module`` made without
``share_memory_arenas``, so every method it loads gets a KV cache of its own. A runner that runs the
prompt through one method and the generated tokens through another therefore continues from an empty
cache and prints wrong text without a word. Each release's choice of methods is written down here,
once; every layout's outcome in every release is derived from it (the config check, the manifest,
the bundle README), and ``tests/test_stock_runners.py`` runs the real runners of these releases.

A *layout* names the methods in the program. Method *kinds* (``exporters.program.methods``) say what a
method computes: ``prefill`` and ``forward`` take a prompt, ``decode`` one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from exporters.program.versions import EXECUTORCH, STOCK_RUNNER_RELEASES
from exporters.errors import UserError
from exporters.manifest import LayoutEntry, RunnerEntry


@dataclass(frozen=True)
class StockRunner:
    """How one ExecuTorch release's stock ``TextLLMRunner`` chooses the methods it calls."""

    release: str
    prompt_methods: tuple[str, ...]  # the first of these the program has runs the prompt
    decode_method: str | None  # when the program has it, it runs the generated tokens
    shares_kv_cache: bool = False  # whether its methods see one KV cache (share_memory_arenas)

    def outcome(self, methods: Collection[str], dynamic: bool = True) -> "RunnerOutcome":
        prompt = next((m for m in self.prompt_methods if m in methods), None)
        if prompt is None:
            return RunnerOutcome(self.release, None, None, "fails",
                                 f"it needs a method named {' or '.join(self.prompt_methods)} and stops with an error")
        if not dynamic:  # enable_dynamic_shape=false: it feeds the prompt one token at a time
            return RunnerOutcome(self.release, prompt, prompt, "fails",
                                 f"it feeds {prompt} one token at a time, and {prompt} takes a fixed chunk",
                                 fix=FIXED_SHAPES_FIX)
        step = self.decode_method if self.decode_method in methods else prompt
        if step != prompt and not self.shares_kv_cache:
            return RunnerOutcome(self.release, prompt, step, "wrong text",
                                 f"it runs the prompt through {prompt} and the new tokens through {step}, "
                                 f"each with its own KV cache")
        return RunnerOutcome(self.release, prompt, step, "correct",
                             f"it runs the prompt and the new tokens through {prompt}" if step == prompt else
                             f"it runs the prompt through {prompt} and the new tokens through {step}")


FIXED_SHAPES_FIX = ("The stock runners need a prompt method of any length, which this backend does not export: run the "
                    "program with exporters.generate, or an app that feeds prompts in chunks of export.prefill_chunk "
                    "tokens and shares memory arenas between methods")


@dataclass(frozen=True)
class RunnerOutcome:
    release: str
    prompt_method: str | None
    step_method: str | None
    result: str  # "correct", "wrong text" or "fails"
    why: str
    fix: str = "export.layout=stock (with forward in export.methods) makes a program every stock runner runs correctly"

    @property
    def correct(self) -> bool:
        return self.result == "correct"

    def describe(self) -> str:
        return f"ExecuTorch {self.release} stock runner: {self.result} ({self.why})"


# The releases we claim, oldest first (each rule read from that release's llm_runner_helper.cpp).
STOCK_RUNNERS: tuple[StockRunner, ...] = (
    # 1.4.x: one method, "forward", for the prompt and every generated token.
    StockRunner(STOCK_RUNNER_RELEASES[0], prompt_methods=("forward",), decode_method=None),
    # 1.5.x: "forward", else "prefill", for the prompt; "decode" for the tokens whenever it exists.
    StockRunner(STOCK_RUNNER_RELEASES[1], prompt_methods=("forward", "prefill"), decode_method="decode"),
)


@dataclass(frozen=True)
class Layout:
    name: str
    method_names: dict[str, str]  # method kind -> its name in the program
    for_whom: str

    def name_of(self, kind: str) -> str:
        return self.method_names[kind]

    def runner_outcomes(self, kinds: Collection[str], dynamic: bool = True) -> list[RunnerOutcome]:
        """What each stock runner does with a program of these method kinds (``dynamic``: prompt length)."""
        names = {self.name_of(k) for k in kinds}
        return [runner.outcome(names, dynamic) for runner in STOCK_RUNNERS]


# ExecuTorch's MultimodalRunner finds its methods by these names (extension/llm/runner/constants.h), whatever the
# layout: the text methods of a vision-language program.
MULTIMODAL_NAMES = {"token_embedding": "token_embedding", "text_decoder": "text_decoder"}

LAYOUTS: dict[str, Layout] = {
    # Correct in every stock runner above: they run the prompt and the tokens through forward; apps
    # that share the KV cache between methods (Module with share_memory_arenas=true, our generate)
    # run the prompt through prefill and each token through the faster one-token method.
    "stock": Layout("stock", {"prefill": "prefill", "decode": "decode_one_token", "forward": "forward",
                              "verify": "verify", **MULTIMODAL_NAMES},
                    "ExecuTorch's stock runners and apps that share memory arenas between methods"),
    # ExecuTorch's two-method naming (prefill/decode). Needs a runtime that shares memory arenas
    # between methods; ExecuTorch 1.5.1's stock runner does not and prints wrong text with it.
    "split": Layout("split", {"prefill": "prefill", "decode": "decode", "forward": "forward", "verify": "verify",
                              **MULTIMODAL_NAMES},
                    f"apps whose runtime shares memory arenas between methods (not ExecuTorch {EXECUTORCH}'s stock runner)"),
}

# Every name a method of some layout has -> its kind (how a loaded program's methods are recognised).
KIND_OF_NAME: dict[str, str] = {name: kind for layout in LAYOUTS.values() for kind, name in layout.method_names.items()}


def check_layout(layout_name: str, kinds: Collection[str], dynamic: bool = True) -> Layout:
    """The layout, if every stock runner it promises to serve runs the program correctly."""
    if layout_name not in LAYOUTS:
        raise UserError(f"export.layout={layout_name!r} is not known. Allowed: {', '.join(LAYOUTS)}.")
    layout = LAYOUTS[layout_name]
    if not dynamic and "decode" not in kinds:
        raise UserError(
            f"export.methods={list(kinds)}: this backend exports prompt methods with a fixed chunk of "
            "export.prefill_chunk tokens, so without decode nothing in the program takes one token at a time and "
            "it could not generate. Add decode to export.methods."
        )
    if layout_name == "stock":
        bad = [o for o in layout.runner_outcomes(kinds, dynamic) if not o.correct]
        if bad:
            fix = ("Add forward to export.methods, or set" if dynamic else
                   "This backend exports static shapes (export.prefill_chunk), which no stock runner runs: set")
            raise UserError(
                f"export.layout=stock promises correct text in ExecuTorch's stock runners, but with "
                f"export.methods={list(kinds)} " + "; ".join(o.describe() for o in bad) + f". {fix} "
                "export.layout=split for an app that shares memory arenas between methods."
            )
    return layout


def at_the_cache_end(outcome: RunnerOutcome, slides: bool, sink: bool) -> RunnerOutcome:
    """What a runner that runs the program correctly does at the end of its cache.

    Every release here (1.4.1 and 1.5.1, ``TextLLMRunner::generate``) takes ``get_max_seq_len <
    get_max_context_len`` for a sliding-window program: it stops checking the position against the cache and lets
    one generate() call produce up to get_max_context_len tokens, then goes on from there in the next call. With an
    attention sink that is what the program is for; without one, the program stops the runner with an error at the
    end of the cache ("Generation failed"; checked in tests/test_long_context.py)."""
    if not outcome.correct or not slides or sink:
        return outcome
    return RunnerOutcome(
        outcome.release, outcome.prompt_method, outcome.step_method, "fails",
        f"{outcome.why}, correctly, until the end of the cache: get_max_seq_len < get_max_context_len makes it "
        "treat the program as sliding-window and generate past the end, where the program stops it with an error",
        fix="export.attention_sink=4 lets the program go on past the cache; or ask the runner for at most "
            "get_max_context_len - prompt tokens, or export with export.max_context_len=null")


def layout_manifest(layout: Layout, methods: dict[str, str], prompt: str, step: str, dynamic: bool,
                    slides: bool = False, sink: bool = False) -> LayoutEntry:
    """The manifest's ``layout`` section: what app developers need to call the program correctly.

    ``methods`` maps each LLM method in the program to its kind; ``prompt`` and ``step`` are the methods an
    app calls for the prompt and for each new token (``exporters.runtime.driver.MethodRoles``). ``slides``: the
    prompt method takes fewer tokens than the cache holds; ``sink``: the program has an attention sink
    (:func:`at_the_cache_end`).
    """
    by_kind = {kind: name for name, kind in methods.items()}
    return LayoutEntry(
        name=layout.name,
        audience=layout.for_whom,
        methods=methods,
        prompt_method=prompt,
        token_method=step,
        call_order=(f"{prompt}(prompt tokens [1, T], position [start]) once, then {step}(token [1, 1], "
                    f"[position]) for each new token at the next position"),
        kv_cache=("one KV cache shared by all methods: load them from one program in a runtime that shares "
                  "memory arenas between methods (C++: executorch::extension::Module with "
                  "share_memory_arenas=true; Python: executorch.runtime)") if prompt != step else
                 "one method holds the KV cache",
        stock_runners={o.release: RunnerEntry(result=o.result, prompt_method=o.prompt_method,
                                                token_method=o.step_method, why=o.why,
                                                fix="" if o.correct else o.fix)
                       for o in (at_the_cache_end(o, slides, sink) for o in layout.runner_outcomes(by_kind, dynamic))},
    )
