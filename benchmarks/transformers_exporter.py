"""A Llama-architecture checkpoint through transformers' own ExecuTorch exporter, then greedy generation with it.

    python -m benchmarks.transformers_exporter export --checkpoint DIR --out OUTDIR --max-seq-len 256 \
        [--quant 8da4w|fp32] [--group-size 32] [--static-prefill] [--strategy auto|single|per-component]
    python -m benchmarks.transformers_exporter generate --exported OUTDIR --checkpoint DIR --prompt "..." \
        --max-new-tokens 20 [--threads N] [--api flat|transformers] [--no-compare-eager]
    python -m benchmarks.transformers_exporter perplexity --exported OUTDIR --checkpoint DIR [--text FILE]

One of the peers benchmark's exporters (ours, ExecuTorch's ``export_llm``, optimum-executorch, this one). It does
what a transformers user would: ``AutoModelForCausalLM.from_pretrained(dtype=float32)``, for 8da4w with
``quantization_config=TorchAoConfig(Int8DynamicActivationIntxWeightConfig(int4, PerGroup(g)))`` (torchao's
``quantize_`` on the loaded model if that fails), then ``ExecutorchExporter`` (XNNPACK) on a static cache of
``--max-seq-len`` positions, and ``ExportedModel.save_pretrained``. Each command prints one JSON line.

What transformers' exporter produces (transformers 5.23, ExecuTorch 1.5.1): ``prefill.pte`` and ``decode.pte``,
each a self-contained program with one method, ``forward``, plus ``export.json`` (per program: the traced kwargs,
the pytree specs of its inputs and outputs), ``config.json`` and ``generation_config.json``. The export command
adds ``transformers_exporter.json`` (how it was quantized and exported, timings, each method's inputs/outputs).

- ``prefill.forward(input_ids [1,T], position_ids [1,T], cumulative_length x L)``: the cache is created from zeros
  inside the graph; returns each layer's mutated ``cumulative_length``, the logits of *every* prompt position
  ``[1,T,V]``, then the cache (``keys, values, cumulative_length`` per layer: 3L tensors).
- ``decode.forward(input_ids [1,1], attention_mask [1,1,1,S] bool, position_ids [1,1], 3L cache tensors)``:
  returns the 3L mutated cache inputs, the logits ``[1,1,V]``, then the 3L cache tensors again. The caller
  carries the cache from step to step and builds the 4-D mask (slots ``<= position`` visible).

Limits found (and what this script does about them):

- The KV cache is program input and output, not a mutable buffer: every decode step copies the whole
  ``2 x L x S`` cache into the program's arena and out again (twice), and ExecuTorch's Python ``execute`` clones
  every output. Attention (GQA ``expand_copy``, mask ``where``, cache ``index_put``, RMSNorm ``mean``) stays in
  portable kernels: ~1100 non-delegated kernel calls per decode step for SmolLM2-135M, 154 XNNPACK calls.
- Each program holds a full copy of the weights, and the tied embedding is stored twice in each (the embedding in
  the program, the lm_head packed in XNNPACK); ``TorchAoConfig`` quantizes neither, so both stay fp32.
- ``export_for_generation`` on a torchao-quantized model fails on its second component (see
  ``export_per_component``); ``--strategy auto`` then exports each component from a fresh model instead.
- Called plainly, ``export_for_generation`` traces the prefill at the sample prompt's exact token count. Here the
  prefill gets a dynamic sequence axis (1 to ``max_seq_len - 1``) through the per-component config dict, unless
  ``--static-prefill``; a prompt the prefill can't take goes through decode one token at a time.
- No constant methods (``get_max_seq_len``, ...) and no ``(tokens, start_pos)`` signature: ExecuTorch's stock
  ``TextLLMRunner`` rejects both programs ("Required metadata method get_max_seq_len not found in model").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_PROMPT = "The capital of France is"
INFO_FILE = "transformers_exporter.json"  # what the export command recorded, beside transformers' files
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "exporters" / "data" / "validation_text.txt"


# ── export ────────────────────────────────────────────────────────────────────


def load_model(checkpoint: Path, quant: str, group_size: int) -> tuple[Any, str]:
    """The checkpoint as an fp32 ``LlamaForCausalLM``, quantized for ``quant=8da4w``, and how it was quantized."""
    from transformers import AutoModelForCausalLM

    if quant == "fp32":
        return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval(), "none"
    if quant != "8da4w":
        raise SystemExit(f"--quant {quant}: use fp32 or 8da4w.")
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, PerGroup
    from transformers import TorchAoConfig

    ao_config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     quantization_config=TorchAoConfig(ao_config))
        how = "transformers TorchAoConfig(Int8DynamicActivationIntxWeightConfig) at from_pretrained"
    except Exception as e:  # noqa: BLE001 - any failure of that path falls back to quantize_, and is reported
        from torchao.quantization import quantize_

        print(f"TorchAoConfig path failed ({type(e).__name__}: {e}); quantizing with torchao.quantize_",
              file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        quantize_(model, ao_config)
        how = "torchao.quantization.quantize_ on the loaded model (TorchAoConfig path failed)"
    return model.eval(), how


def quantized_weights(model: Any) -> dict[str, str]:
    """``{module: weight class}`` for the modules whose weight is a torchao quantized tensor subclass."""
    return {name: type(module.weight).__name__ for name, module in model.named_modules()
            if isinstance(getattr(module, "weight", None), torch.Tensor)
            and type(module.weight) not in (torch.Tensor, torch.nn.Parameter)}


def generation_config(max_seq_len: int, max_new_tokens: int | None = None) -> Any:
    """Greedy generation on a static cache of ``max_seq_len`` positions, never stopping at eos (fixed length)."""
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=max_seq_len, do_sample=False,
                            max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=None)


def export_configs(model: Any, max_seq_len: int, static_prefill: bool) -> Any:
    """One ``ExecutorchConfig`` for both programs, or a dict giving the prefill a dynamic sequence axis."""
    from transformers.exporters.configs import ExecutorchConfig

    if static_prefill:
        return ExecutorchConfig()
    tokens = torch.export.Dim("prompt_tokens", min=1, max=max_seq_len - 1)
    # The prefill's cache input is one leaf per layer (its cumulative_length, a scalar): all static.
    prefill = ExecutorchConfig(dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens},
                                               "past_key_values": [None] * model.config.num_hidden_layers})
    return {"prefill": prefill, "decode": ExecutorchConfig()}


SCALAR_TYPES = {0: "uint8", 1: "int8", 3: "int32", 4: "int64", 5: "float16", 6: "float32", 11: "bool", 15: "bfloat16"}


def tensor_infos(count: int, info: Any) -> list[str]:
    """``dtype[sizes]`` of each of a method's inputs or outputs (a dynamic axis shows its upper bound)."""
    return [f"{SCALAR_TYPES.get(int(info(i).dtype()), info(i).dtype())}{list(info(i).sizes())}" for i in range(count)]


def describe_program(path: Path) -> dict[str, Any]:
    """A .pte's size, and the inputs and outputs of each of its methods, as the ExecuTorch runtime reads them."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(path)
    methods = {}
    for name in sorted(program.method_names):
        meta = program.metadata(name)
        methods[name] = {"inputs": tensor_infos(meta.num_inputs(), meta.input_tensor_meta),
                         "outputs": tensor_infos(meta.num_outputs(), meta.output_tensor_meta)}
    return {"bytes": path.stat().st_size, "methods": methods}


def summarize(weights: dict[str, str]) -> dict[str, Any]:
    """How many modules got which quantized weight class, and whether the embedding and lm_head did."""
    classes: dict[str, int] = {}
    for cls in weights.values():
        classes[cls] = classes.get(cls, 0) + 1
    return {"classes": classes, "embed_tokens": any(n.endswith("embed_tokens") for n in weights),
            "lm_head": "lm_head" in weights}


def export_per_component(args: argparse.Namespace, sample: Any, gen_config: Any) -> tuple[Any, dict[str, float]]:
    """``export_for_generation``'s work, one component at a time, each from a freshly loaded model.

    ``export_for_generation`` exports every component from the same model, and ExecuTorch's backend
    preparation calls ``model.to("cpu")``, which swaps each tensor-subclass parameter (torchao's quantized
    weights) with ``torch.utils.swap_tensors``. The first export leaves a weak reference on those parameters (the
    fake-tensor converter of its program), so on the second component the swap fails: ``RuntimeError: _apply():
    Couldn't swap Linear.weight`` (``Cannot swap t1 because it has weakref associated with it``). Here each
    component gets its own model, through the same public steps: ``decompose_for_generation``, then
    ``ExecutorchExporter.export`` of that component. Returns the ``ExportedModel`` and each component's seconds
    (its model load included)."""
    from transformers.exporters import ExecutorchExporter, ExportedModel
    from transformers.exporters.utils import decompose_for_generation

    exporter = ExecutorchExporter()
    components, seconds = {}, {}
    for name in ("prefill", "decode"):
        start = time.perf_counter()
        model, _ = load_model(Path(args.checkpoint), args.quant, args.group_size)
        configs = export_configs(model, args.max_seq_len, args.static_prefill)
        submodel, inputs = decompose_for_generation(model, dict(sample), generation_config=gen_config)[name]
        config = configs[name] if isinstance(configs, dict) else configs
        components[name] = exporter.export(submodel, inputs, config).components["model"]
        seconds[name] = round(time.perf_counter() - start, 2)
    exported = ExportedModel(components, exporter.export_format, config=model.config, generation_config=gen_config)
    return exported, seconds


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Load, quantize, export both programs, ``save_pretrained``; what was written and how long it took."""
    from transformers import AutoTokenizer
    from transformers.exporters import ExecutorchExporter

    torch.manual_seed(0)
    out = Path(args.out)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    sample = tokenizer(args.prompt, return_tensors="pt")
    gen_config = generation_config(args.max_seq_len)
    per_component = args.strategy == "per-component" or (args.strategy == "auto" and args.quant != "fp32")
    start = time.perf_counter()
    model, how = load_model(Path(args.checkpoint), args.quant, args.group_size)
    load_s = time.perf_counter() - start
    quantized = summarize(quantized_weights(model))
    start = time.perf_counter()
    component_s: dict[str, float] = {}
    if per_component:
        del model
        exported, component_s = export_per_component(args, sample, gen_config)
    else:
        exported = ExecutorchExporter().export_for_generation(
            model, sample, export_configs(model, args.max_seq_len, args.static_prefill), generation_config=gen_config)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    exported.save_pretrained(out)
    save_s = time.perf_counter() - start
    manifest = json.loads((out / "export.json").read_text())
    info = {
        "checkpoint": str(args.checkpoint), "quant": args.quant,
        "group_size": args.group_size if args.quant == "8da4w" else None,
        "quantized_with": how, "quantized_weights": quantized,
        "export_call": ("decompose_for_generation + ExecutorchExporter.export per component, a fresh model each"
                        if per_component else "ExecutorchExporter.export_for_generation"),
        "max_seq_len": args.max_seq_len, "static_prefill": args.static_prefill,
        "sample_prompt_tokens": int(sample["input_ids"].shape[1]),
        "load_s": round(load_s, 2), "export_s": round(export_s, 2),
        "component_s": component_s, "save_s": round(save_s, 2),
        "programs": {name: {"file": entry["file"], "traced_kwargs": list(entry["metadata"]["kwargs"]),
                            **describe_program(out / entry["file"])}
                     for name, entry in manifest["components"].items()},
        "files": {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()},
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


# ── running the programs ──────────────────────────────────────────────────────


@dataclass
class ExportedLM:
    """The two programs of an export, driven greedily: prefill once, then one decode step per token.

    With ``api="transformers"`` every call goes through transformers' ``ExecutorchModelRunner`` (kwargs and a
    ``StaticCache`` in, ``CausalLMOutputWithPast`` out: the pytree flattening a transformers user pays); with
    ``api="flat"`` the same loaded ``forward`` methods get flat tensor lists, the cache kept as the list of
    tensors the program returned (what a hand-written runner would do)."""

    exported: Any  # transformers.exporters.ExportedModel
    api: str
    max_seq_len: int
    prefill_max: int  # the most prompt tokens the prefill program takes
    prefill_min: int
    layers: int

    @classmethod
    def load(cls, outdir: Path, api: str) -> "ExportedLM":
        """``ExportedModel.from_pretrained(outdir)``, checked against the flat layout ``prefill``/``step`` feed."""
        from transformers.exporters import ExportedModel

        exported = ExportedModel.from_pretrained(outdir)
        manifest = json.loads((outdir / "export.json").read_text())["components"]
        layers = exported.config.num_hidden_layers
        layouts = {"prefill": (["input_ids", "position_ids", "past_key_values"], 2 + layers),
                   "decode": (["input_ids", "attention_mask", "position_ids", "past_key_values"], 3 + 3 * layers)}
        for name, (kwargs, inputs) in layouts.items():
            traced = list(manifest[name]["metadata"]["kwargs"])
            found = exported.runners[name].method.metadata.num_inputs()
            if traced != kwargs or found != inputs:
                raise SystemExit(f"{outdir}: {name} was traced with {traced} ({found} inputs); this script drives "
                                 f"{kwargs} ({inputs} inputs for a {layers}-layer StaticCache).")
        prefill = manifest["prefill"]["metadata"]
        traced = prefill["kwargs"]["input_ids"]["shape"][1]
        dynamic = prefill["export_config"].get("dynamic_shapes") is not None or prefill["export_config"]["dynamic"]
        method = exported.runners["prefill"].method
        bound = list(method.metadata.input_tensor_meta(0).sizes())[1]  # upper bound of a dynamic axis
        return cls(exported, api, max_seq_len=exported.generation_config.max_cache_len,
                   prefill_max=bound if dynamic else traced, prefill_min=1 if dynamic else traced,
                   layers=layers)

    def _mask(self, position: int) -> torch.Tensor:
        """The decode program's attention mask: cache slots up to ``position`` visible."""
        return (torch.arange(self.max_seq_len) <= position).view(1, 1, 1, -1)

    def empty_cache(self) -> Any:
        """A cache at position 0, in the form ``step`` takes."""
        if self.api == "transformers":
            from transformers import StaticCache

            cache = StaticCache(config=self.exported.config, max_cache_len=self.max_seq_len)
            cache.early_initialization(1, self.exported.config.num_key_value_heads,
                                       self.exported.config.head_dim, torch.float32, torch.device("cpu"))
            return cache
        meta = self.exported.runners["decode"].method.metadata
        infos = [meta.input_tensor_meta(i) for i in range(3, meta.num_inputs())]  # keys, values, length per layer
        return [torch.zeros(list(info.sizes()), dtype=getattr(torch, SCALAR_TYPES[int(info.dtype())]))
                for info in infos]

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Logits of the last prompt token [V], and the cache after the prompt."""
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        if self.api == "transformers":
            from transformers import StaticCache

            out = self.exported.runners["prefill"](
                input_ids=ids, position_ids=positions,
                past_key_values=StaticCache(config=self.exported.config, max_cache_len=self.max_seq_len))
            return out.logits[0, -1], out.past_key_values
        outputs = self.exported.runners["prefill"].method.execute(
            [ids, positions, *(torch.zeros((), dtype=torch.int64) for _ in range(self.layers))])
        return outputs[self.layers][0, -1], list(outputs[self.layers + 1:])

    def step(self, token: int, position: int, cache: Any) -> tuple[torch.Tensor, Any]:
        """Logits [V] after ``token`` at ``position``, and the cache with it."""
        ids, positions = torch.tensor([[token]]), torch.tensor([[position]])
        if self.api == "transformers":
            out = self.exported.runners["decode"](input_ids=ids, attention_mask=self._mask(position),
                                                  position_ids=positions, past_key_values=cache)
            return out.logits[0, -1], out.past_key_values
        outputs = self.exported.runners["decode"].method.execute([ids, self._mask(position), positions, *cache])
        leaves = 3 * self.layers
        return outputs[leaves][0, -1], list(outputs[leaves + 1:])

    def start(self, ids: torch.Tensor) -> tuple[torch.Tensor, Any, str]:
        """Run the prompt: through prefill when it takes that length, else one decode step per token."""
        if self.prefill_min <= ids.shape[1] <= self.prefill_max:
            logits, cache = self.prefill(ids)
            return logits, cache, "prefill"
        cache = self.empty_cache()
        for position, token in enumerate(ids[0].tolist()):
            logits, cache = self.step(token, position, cache)
        return logits, cache, "decode steps (prefill traced for another length)"

    def generate(self, ids: torch.Tensor, max_new_tokens: int, warmup: int) -> dict[str, Any]:
        """Greedy ids and timings; decode tok/s over the steps after the first ``warmup``."""
        if ids.shape[1] + max_new_tokens > self.max_seq_len:
            raise SystemExit(f"{ids.shape[1]} prompt + {max_new_tokens} new tokens exceed the cache "
                             f"({self.max_seq_len}).")
        start = time.perf_counter()
        logits, cache, prompt_path = self.start(ids)
        prefill_s = time.perf_counter() - start
        new = [int(logits.argmax())]
        step_times = []
        for position in range(ids.shape[1], ids.shape[1] + max_new_tokens - 1):
            start = time.perf_counter()
            logits, cache = self.step(new[-1], position, cache)
            new.append(int(logits.argmax()))
            step_times.append(time.perf_counter() - start)
        steady = step_times[warmup:] or step_times
        return {"ids": new, "prompt_path": prompt_path, "prefill_s": round(prefill_s, 4),
                "decode_steps_timed": len(steady),
                "decode_tok_s": round(len(steady) / sum(steady), 2) if steady else None}


def eager_generate(model: Any, ids: torch.Tensor, max_new_tokens: int, max_seq_len: int) -> list[int]:
    """The eager model's greedy ``generate`` on the same static cache as the export's."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             generation_config=generation_config(max_seq_len, max_new_tokens))
    return out[0, ids.shape[1]:].tolist()


def eager_view(model: Any, ids: torch.Tensor, program_ids: list[int], index: int) -> dict[str, Any]:
    """At the first position where the program's greedy token differs from eager generate's: what the eager
    model's full-sequence forward (prompt and the program's tokens before it) ranks first, and how far the
    program's token is below it, in logits (a near tie, a few tenths, is quantization noise, not a bug)."""
    with torch.no_grad():
        logits = model(torch.cat([ids, torch.tensor([program_ids[:index]], dtype=ids.dtype)], 1)).logits[0, -1]
    top2 = logits.topk(2)
    return {"eager_forward_argmax": int(top2.indices[0]),
            "eager_forward_top2_margin": round(float(top2.values[0] - top2.values[1]), 3),
            "program_token_gap": round(float(top2.values[0] - logits[program_ids[index]]), 3)}


def export_info(outdir: Path) -> dict[str, Any]:
    path = outdir / INFO_FILE
    return json.loads(path.read_text()) if path.exists() else {"quant": "fp32", "group_size": None}


def set_threads(threads: int | None) -> int:
    """Size ExecuTorch's threadpool (XNNPACK's threads; default one per core), and keep torch to one thread.

    ExecuTorch's Python ``Method.execute`` copies every output into a new torch tensor (``clone``): 181 outputs per
    decode step here, 120 of them cache tensors. With torch's default OpenMP threads each copy is a parallel region,
    and on a busy machine a region waits for a descheduled thread: decode steps went from 18 ms to 1 s, at random."""
    from executorch.extension.pybindings import portable_lib

    torch.set_num_threads(1)
    if threads:
        portable_lib._unsafe_reset_threadpool(threads)
        return threads
    return int(portable_lib._threadpool_get_thread_count())


def generate(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    outdir = Path(args.exported)
    info = export_info(outdir)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    threads = set_threads(args.threads)  # before any program is loaded: a loaded XNNPACK delegate keeps its pool
    start = time.perf_counter()
    lm = ExportedLM.load(outdir, args.api)
    load_s = time.perf_counter() - start
    run = lm.generate(ids, args.max_new_tokens, args.warmup)
    result = {"exporter": "transformers.exporters.ExecutorchExporter", "api": args.api, "quant": info["quant"],
              "threads": threads, "prompt": args.prompt, "prompt_tokens": int(ids.shape[1]),
              "load_s": round(load_s, 2),
              "text": tokenizer.decode(run["ids"]), **run}
    if args.compare_eager:
        model, _ = load_model(Path(args.checkpoint), info["quant"], info["group_size"] or 32)
        eager = eager_generate(model, ids, args.max_new_tokens, lm.max_seq_len)
        result.update(eager_ids=eager, eager_text=tokenizer.decode(eager), matches_eager=run["ids"] == eager)
        if run["ids"] != eager:
            index = next(i for i, (a, b) in enumerate(zip(run["ids"], eager)) if a != b)
            result.update(first_mismatch=index, at_first_mismatch=eager_view(model, ids, run["ids"], index))
    return result


# ── perplexity ────────────────────────────────────────────────────────────────


def text_windows(ids: list[int], bos: int | None, context: int, prompt_tokens: int,
                 max_tokens: int) -> list[torch.Tensor]:
    """Windows of at most ``context`` tokens (bos first), until ``max_tokens`` predictions are scored."""
    windows, scored, start = [], 0, 0
    body = context - (bos is not None)
    while start < len(ids) and scored < max_tokens:
        window = ([bos] if bos is not None else []) + ids[start:start + body]
        start += body
        window = window[:prompt_tokens + max_tokens - scored]
        if len(window) < prompt_tokens + 8:
            break
        windows.append(torch.tensor([window]))
        scored += len(window) - prompt_tokens
    return windows


def negative_log_likelihood(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum over positions of -log p(target): logits [N, V], targets [N]."""
    return -float(torch.log_softmax(logits.double(), -1).gather(-1, targets.view(-1, 1)).sum())


def perplexity(args: argparse.Namespace) -> dict[str, Any]:
    """Perplexity of the decode program, fed the text one token at a time (teacher forcing), and of the eager
    model on the same windows; each window's first ``--prompt-tokens`` are context, not scored."""
    from transformers import AutoTokenizer

    outdir = Path(args.exported)
    info = export_info(outdir)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    threads = set_threads(args.threads)
    lm = ExportedLM.load(outdir, "flat")
    text = Path(args.text).read_text(encoding="utf-8")
    context = min(args.context or lm.max_seq_len, lm.max_seq_len)
    windows = text_windows(tokenizer(text)["input_ids"], None if args.no_bos else tokenizer.bos_token_id, context,
                           args.prompt_tokens, args.max_tokens)
    nll, scored, predictions = 0.0, 0, []
    start = time.perf_counter()
    for window in windows:
        cache, rows = lm.empty_cache(), []
        for position, token in enumerate(window[0, :-1].tolist()):
            logits, cache = lm.step(token, position, cache)
            if position >= args.prompt_tokens - 1:
                rows.append(logits.clone())
        predictions.append(torch.stack(rows))
        nll += negative_log_likelihood(predictions[-1], window[0, args.prompt_tokens:])
        scored += window.shape[1] - args.prompt_tokens
    seconds = time.perf_counter() - start
    result = {"quant": info["quant"], "threads": threads, "text": str(args.text), "windows": len(windows),
              "context": context, "prompt_tokens": args.prompt_tokens, "scored_tokens": scored,
              "perplexity": round(math.exp(nll / scored), 4), "decode_steps_s": round(seconds, 2)}
    if args.compare_eager:
        model, _ = load_model(Path(args.checkpoint), info["quant"], info["group_size"] or 32)
        eager_nll, top1 = 0.0, 0
        with torch.no_grad():
            for window, program in zip(windows, predictions):
                eager = model(window).logits[0, args.prompt_tokens - 1:-1]
                eager_nll += negative_log_likelihood(eager, window[0, args.prompt_tokens:])
                top1 += int((eager.argmax(-1) == program.argmax(-1)).sum())
        result.update(eager_perplexity=round(math.exp(eager_nll / scored), 4),
                      top1_agreement_with_eager=round(top1 / scored, 4))
    return result


# ── command line ──────────────────────────────────────────────────────────────


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    exp = commands.add_parser("export", help="export a checkpoint folder with transformers' ExecutorchExporter")
    exp.add_argument("--checkpoint", required=True, help="a Hugging Face Llama-architecture checkpoint folder")
    exp.add_argument("--out", required=True, help="the folder save_pretrained writes")
    exp.add_argument("--max-seq-len", type=int, default=256, help="static cache positions")
    exp.add_argument("--quant", choices=["fp32", "8da4w"], default="fp32")
    exp.add_argument("--group-size", type=int, default=32)
    exp.add_argument("--prompt", default=DEFAULT_PROMPT, help="the sample prompt generate() is captured with")
    exp.add_argument("--strategy", choices=["auto", "single", "per-component"], default="auto",
                     help="one export_for_generation call, or each component from a fresh model (auto: "
                          "single for fp32, per-component for a quantized model, where the single call fails)")
    exp.add_argument("--static-prefill", action="store_true",
                     help="the plain export_for_generation call: prefill traced at the sample prompt's length only")

    gen = commands.add_parser("generate", help="greedy generation with the exported programs")
    gen.add_argument("--exported", required=True)
    gen.add_argument("--checkpoint", required=True, help="for the tokenizer (and the eager comparison)")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT)
    gen.add_argument("--max-new-tokens", type=int, default=20)
    gen.add_argument("--warmup", type=int, default=3, help="decode steps left out of tok/s")
    gen.add_argument("--api", choices=["flat", "transformers"], default="flat",
                     help="flat tensor lists to the loaded methods, or transformers' runners (pytree in and out)")
    gen.add_argument("--no-compare-eager", dest="compare_eager", action="store_false",
                     help="skip the eager model's greedy generate")

    ppl = commands.add_parser("perplexity", help="perplexity of the decode program, one token per step")
    ppl.add_argument("--exported", required=True)
    ppl.add_argument("--checkpoint", required=True)
    ppl.add_argument("--text", default=str(DEFAULT_TEXT))
    ppl.add_argument("--context", type=int, default=None, help="window length (default: the cache length)")
    ppl.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each window not scored")
    ppl.add_argument("--max-tokens", type=int, default=256, help="scored tokens in all")
    ppl.add_argument("--no-compare-eager", dest="compare_eager", action="store_false")
    ppl.add_argument("--no-bos", action="store_true",
                     help="windows without a bos token first (as benchmarks.export scores every program)")

    for command in (gen, ppl):
        command.add_argument("--threads", type=int, default=None,
                             help="ExecuTorch threadpool size (default: its own, one per core)")
    args = parser.parse_args(argv)
    run = {"export": export, "generate": generate, "perplexity": perplexity}[args.command]
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
