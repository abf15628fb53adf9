"""Release bundles: a directory and a ``.tar.gz`` an app team can ship, with every file's sha256.

The archive is deterministic (sorted entries, fixed mtime/owner, gzip without timestamp): packaging
the same export twice gives the same bytes.
"""

from __future__ import annotations

import gzip
import io
import json
import shutil
import tarfile
from pathlib import Path

from exporters.program.versions import STOCK_RUNNER_RELEASES
from exporters.errors import UserError
from exporters.output.folder import check_writable
from exporters.output.files import sha256_of
from exporters.manifest import MANIFEST_FILE, Manifest, ValidationReport
from exporters.program.weights import data_files_beside
from exporters.program.vision import PATCH_ROW_FAMILIES, PROCESSOR_FILES
from models.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILES

BUNDLED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", CHAT_TEMPLATE_FILE, "generation_config.json",
           *PROCESSOR_FILES)


def _how_to_run(m: Manifest, tokenizer: str) -> str:
    """Which methods to call in which order, what the runtime must do for the shared KV cache, and which
    stock runners run the program correctly (from the manifest's ``layout``)."""
    layout = m.layout
    prompt, step = layout.prompt_method, layout.token_method
    runners = "\n".join(f"| {release} | {o.result} | {o.why} |" for release, o in layout.stock_runners.items())
    tested = m.versions.get("executorch")
    pte = m.program.file
    data = m.data.file if m.data else None
    data_arg = f', data_path="{data}"' if data else ""
    module_files = f'"{pte}", "{data}"' if data else f'"{pte}"'
    runner_data = f', "{data}"' if data else ""
    return f"""Layout `{layout.name}` (for {layout.audience}). Call {layout.call_order}.
{layout.kv_cache[0].upper() + layout.kv_cache[1:]}.

```python
from executorch.runtime import Runtime   # shares memory arenas between the methods of a program
program = Runtime.get().load_program("{pte}"{data_arg})
prompt = program.load_method("{prompt}")   # tokens int64[1, T], input_pos int64[1] -> logits[1, vocab]
step = program.load_method("{step}")       # tokens int64[1, 1], input_pos int64[1] -> logits[1, vocab]
logits = prompt.execute([prompt_ids, torch.tensor([0])])[0]
logits = step.execute([next_id.view(1, 1), torch.tensor([len(prompt_ids[0])])])[0]
```

In C++: `executorch::extension::Module module({module_files}, Module::LoadMode::MmapUseMlockIgnoreErrors,
nullptr, nullptr, nullptr, /*share_memory_arenas=*/true);` then `module.execute("{prompt}", ...)` and
`module.execute("{step}", ...)`. Without `share_memory_arenas` each method has its own KV cache and the
text is wrong, with no error.

ExecuTorch's stock runner (`executorch.extension.llm.runner.TextLLMRunner("{pte}", "{tokenizer}"{runner_data})`,
or the C++ `llm::create_text_llm_runner`{", `llama_main --data_paths=" + data + "`" if data else ""}) chooses
methods by name:

| ExecuTorch release | result | how |
|---|---|---|
{runners}

Validated in the ExecuTorch {tested} Python runtime; the runner outcomes follow each release's method choice
and are tested with that release's runner by llm-exporters' test suite.
{_speculative(m)}
{_runtime_needs(m)}"""


def _speculative(m: Manifest) -> str:
    """How to speculate with the verify method, when the program has one."""
    if "verify" not in m.methods:
        return ""
    k = m.constant_methods.get("get_draft_tokens")
    least = m.constant_methods.get("get_verify_min_tokens")
    most = k + 1 if k is not None else "K+1"
    tokens = f"int64[1, T] with T from {least} to {most}" if least else f"int64[1, {most}]"
    check = m.validation.speculative if m.validation else None
    measured = (f" Validated: {check.describe()}." if check else "")
    return f"""
Speculative decoding: `verify` takes the last accepted token and up to `get_draft_tokens` = {k} proposed tokens
({tokens}, their first position int64[1]) and returns the logits of every position; keep proposals left to right
while each is the model's own choice, then continue from the first position not kept: the next call overwrites the
rejected tokens' cache slots, so nothing else rolls back.{measured}
{_draft(m)}"""


def _draft(m: Manifest) -> str:
    """The draft model's methods, when the program holds one."""
    draft = m.components.get("draft")
    if draft is None:
        return ""
    quant = draft.quantization.describe() if draft.quantization else "unquantized"
    return (f"The draft model ({draft.family or 'unknown'} family, {(draft.parameters or 0) / 1e6:.0f}M parameters, "
            f"{quant}) proposes them: `draft_prefill` takes the text its cache has not seen yet (int64[1, T], its "
            "first position int64[1]) and `draft_decode_one_token` one token at a time, each returning the logits "
            "of its last position; its KV cache is its own, rolled back by position like the target's. "
            + (f"Its logits are {draft.vocabulary.tokens} tokens only (FR-Spec: the most frequent by "
               f"{draft.vocabulary.ranked_by}): `get_draft_vocab` (int64[{draft.vocabulary.tokens}]) gives the token "
               "of each. " if draft.vocabulary else "")
            + "`python -m exporters.generate <folder> prompt=... speculative=draft` does all this.\n")


def _vision_text(m: Manifest) -> str:
    """How an app gives a vision-language program an image."""
    vision = m.components.get("vision")
    if vision is None or vision.vision is None:
        return ""
    v, p = vision.vision, vision.vision.preprocessing
    processor = ("the processor files here do exactly this: `AutoProcessor.from_pretrained(<this folder>)`"
                 if v.family not in PATCH_ROW_FAMILIES else
                 "the processor files here are LFM2-VL's, whose transformers processor keeps the picture's aspect "
                 "ratio and writes patch rows: `models.vision.load_processor(<this folder>)` of llm-exporters makes "
                 "one square, and `exporters.program.vision.program_pixels` folds its rows into these pixels")
    return f"""## Images

`vision_encoder` takes one image as float32 `[1, 3, {v.image_size}, {v.image_size}]`: resize the picture to
{v.image_size} x {v.image_size}, multiply its RGB values by {p.get('rescale_factor', 1 / 255):.6g}, subtract
`{p.get('image_mean')}` and divide by `{p.get('image_std')}` per channel, channels first ({processor}). It returns the image's {v.tokens_per_image}
embeddings, which `text_decoder` takes at the next {v.tokens_per_image} positions; text goes through
`token_embedding` then `text_decoder`. In a prompt the image's place is token {v.image_token_id}
(`{v.image_token}`), {v.tokens_per_image} times.

- Android / iOS (C++): `MultimodalRunner` from `executorch/extension/llm/runner` with a list of inputs: text,
  `Image` (the float CHW pixels above), text; it calls the three methods in order and then decodes.
- Python: `executorch.extension.llm.runner.MultimodalRunner("<program>", "tokenizer.json")` and
  `generate_hf(runner, inputs=processor(images=..., text=...), image_token_id={v.image_token_id})` (its
  `pixel_values` as above).
- `python -m exporters.generate <this folder> prompt="... {v.prompt_marker} ..." image=<file>` (the processor turns
  `{v.prompt_marker}` into the image's tokens).

"""


def _runtime_needs(m: Manifest) -> str:
    """Which files load together, and what makes the methods share their packed weights (with the numbers)."""
    if m.runtime is None:  # manifests written before 0.3
        return ""
    lines = [f"**Files.** Load {m.runtime.load}"]
    if m.data is not None:
        lines.append(f"The program is {m.program.size_bytes / 1e6:.2f} MB and `{m.data.file}` "
                     f"{m.data.size_bytes / 1e6:.2f} MB ({m.data.entries} named tensors). Another export of the "
                     "same model and settings writes the same program bytes with other weights: an app can update "
                     f"`{m.data.file}` alone.")
    lines.append(f"**Weights in memory.** {m.runtime.packed_once}")
    if m.bench is not None and m.bench.rss_after_load_without_weight_cache_mb is not None:
        pss = m.bench.pss_after_load_mb
        lines.append(f"Measured here (RSS a process gains by loading `{m.bench.prompt_method}` and "
                     f"`{m.bench.step_method}`): {m.bench.rss_after_load_mb:.0f} MB with the weight cache, "
                     f"{m.bench.rss_after_load_without_weight_cache_mb:.0f} MB without"
                     + (f"; PSS with the cache {pss:.0f} MB (the runtime maps a data file's tensors once per "
                        "method, which RSS counts per mapping)." if pss is not None and m.data else "."))
    return "\n\n".join(lines)


def _context_text(m: Manifest) -> str:
    """The KV cache an app drives: how long a call and a conversation may be, and what to do at the end."""
    kv = m.kv_cache
    if kv is None:  # manifests written before it was recorded
        return ""
    end = (f"The program has an attention sink (`attention_sink_size` = {kv.attention_sink}): keep calling it with the "
           "true, growing positions past the end of the cache; it keeps the first positions and the most recent ones. "
           f"ExecuTorch's stock runners ({', '.join(STOCK_RUNNER_RELEASES)}) do this across `generate()` calls, each producing at most "
           "`get_max_context_len` tokens." if kv.attention_sink else
           "Stop at `get_max_context_len` positions (or start a new conversation at position 0): the program refuses "
           "positions past its cache." + (" ExecuTorch's stock runners do not stop there for this program "
                                          "(`get_max_seq_len` < `get_max_context_len`): ask them for at most "
                                          "`get_max_context_len` minus the prompt new tokens."
                                          if kv.tokens_per_call < kv.positions - 1 else ""))
    return f"""## Context

KV cache: {kv.describe()}. Feed a prompt in calls of at most `get_max_seq_len` = {kv.tokens_per_call} tokens
(each call at the position after the last); the cache holds `get_max_context_len` = {kv.positions} positions.
{end}

"""


def _swappable_text(m: Manifest) -> str:
    """How an app sets a LoRA adapter in a swappable program: set_adapter's inputs, the files, each one's quality."""
    s = m.swappable
    assert s is not None
    slots = s.slots
    targets = ", ".join(f"`{t['kind']}` ({t['out_features']} x {t['in_features']})" for t in slots["targets"])
    inputs = "\n".join(f"| {i} | `{spec.name}` | {spec.dtype} {spec.shape} |" for i, spec in enumerate(s.inputs))
    rows = "\n".join(f"| `{name}` | `{s.adapters[name].file}` ({s.adapters[name].size_bytes / 1e6:.2f} MB) | "
                     f"r={'/'.join(map(str, a.rank))}, alpha {a.lora_alpha}{', rsLoRA' if a.use_rslora else ''}, "
                     f"{a.layers} layers ({', '.join(a.targets)}) | "
                     + (a.validation.quality() if a.validation else "not validated") + " |"
                     for name, a in m.adapters.items() if name in s.adapters)
    given = (f"""Adapters exported with it, each validated in the runtime against PEFT:

| adapter | file | what it changes | quality |
|---|---|---|---|
{rows}

""" if rows else "")
    return f"""## LoRA adapters, swapped at run time

The base model's methods read LoRA slots of rank {slots['rank']} on {targets} in each of its {slots['layers']} layers
({slots['dtype']}). The method `{s.method}` writes them, and every method computes with what it wrote, until the
next call of `{s.method}`: any PEFT LoRA adapter whose targets are among those and whose rank is at most
{slots['rank']} is data for this program, including one trained after it. `{s.method}` takes, in this order (the
constant method `get_lora_inputs` lists the names), `Aᵀ` and `(scale·B)ᵀ` of every layer, zero past an adapter's
rank and where it changes nothing:

| input | name | dtype, shape |
|---|---|---|
{inputs}

{s.how}

{given}`python -m exporters.adapter <this folder> <PEFT folder> out=<file.ptd>` turns another adapter into such a file,
checked against these shapes; `python -m exporters.generate <this folder> prompt="..." adapter=<name or file>` runs it.

"""


def _adapters_text(m: Manifest) -> str:
    """How an app switches LoRA adapters: each one's methods, and its quality."""
    if m.swappable is not None:
        return _swappable_text(m)
    if not m.adapters:
        return ""
    rows = "\n".join(f"| `{name}` | " + ", ".join(f"`{n}`" for n in a.methods.values()) + f" | r={'/'.join(map(str, a.rank))}, "
                     f"alpha {a.lora_alpha}{', rsLoRA' if a.use_rslora else ''}, {a.layers} layers ({', '.join(a.targets)}) | "
                     + (a.validation.quality() if a.validation else "not validated") + " |"
                     for name, a in m.adapters.items())
    first = next(iter(m.adapters))
    files = [(name, a.data) for name, a in m.adapters.items() if a.data is not None]
    data = "" if not files else (
        "Each adapter's A and B matrices are in its own data file (" + ", ".join(
            f"`{name}`: `{f.file}` {f.size_bytes / 1e6:.2f} MB" for name, f in files) + "), loaded beside the "
        f"base's `{m.data.file if m.data else ''}` to run its methods. An app ships only the adapters it uses (the "
        "base's methods need none of these files), and updates an adapter by replacing its file with one exported "
        "under the same name, ranks and targets: that export's program is the same bytes as this one.\n\n")
    return f"""## LoRA adapters

The program holds the base model's methods and, for each adapter, the same methods with the adapter applied,
named `<adapter>_<method>`; the base weights are stored once. The constant method `get_adapters` lists them
(`"{','.join(m.adapters)}"`). To switch adapters, call the other adapter's methods: they share the KV cache
with every method, so start the new conversation at position 0 (a conversation continued under another
adapter would attend to keys its adapter did not compute).

| adapter | methods | what it changes | quality |
|---|---|---|---|
{rows}

{data}`python -m exporters.generate <this folder> prompt="..." adapter={first}` runs one from Python.

"""


def _validation_text(v: ValidationReport | None) -> str:
    if v is None:
        return "Not validated (exported with validate=false)."
    return (f"Run in the ExecuTorch runtime ({v.checked}) against the eager model on {v.scored_tokens} tokens of "
            f"{v.text}: mean KL divergence {v.kl_mean}, greedy agreement {v.top1_agreement}. Quality: {v.quality()}.")


def _readme(name: str, m: Manifest) -> str:
    cfg = m.config
    rows = "\n".join(
        f"| `{method}` | " + ", ".join(f"`{i.name}`: {i.dtype}{i.shape}" for i in sig.inputs)
        + " | " + ", ".join(f"{o.dtype}{o.shape}" for o in sig.outputs) + " |"
        for method, sig in m.methods.items()
    )
    constants = "\n".join(f"| `{k}` | `{v}` |" for k, v in m.constant_methods.items())
    tokenizer = next((f for f in TOKENIZER_FILES if f in m.tokenizer_files), TOKENIZER_FILES[0])
    return f"""# {name}

ExecuTorch program exported by llm-exporters: model `{cfg['model']['name']}`
({m.model.family} family), quantization `{cfg['quant']['name']}`, backend `{cfg['backend']['name']}`,
context {m.constant_methods.get('get_max_context_len', cfg['export']['max_seq_len'])} tokens, at most
{max(e.tokens[1] for e in m.methods.values())} per call.

## Run it

{_how_to_run(m, tokenizer)}

## Methods

| method | inputs | outputs |
|---|---|---|
{rows}

## Constant methods

| method | value |
|---|---|
{constants}

{_context_text(m)}{_vision_text(m)}{_adapters_text(m)}## Validation

{_validation_text(m.validation)}

Every file's sha256 is in `manifest.json`; check them with `python -m exporters.package --verify <this folder>`.
"""


def make_bundle(run_dir: Path, out: Path | None = None) -> tuple[Path, Path]:
    """Write ``<out>/<name>/`` and ``<out>/<name>.tar.gz`` from a finished run folder."""
    manifest_file = run_dir / MANIFEST_FILE
    m = Manifest.read(manifest_file) if manifest_file.is_file() else None
    if m is None or not (run_dir / m.program.file).is_file():
        raise UserError(f"{run_dir}: not a finished export (needs manifest.json and the program it names).")
    pte = run_dir / m.program.file
    if not m.ok:
        raise UserError(f"{run_dir}: the export's status is {m.status!r}; only validated exports are packaged.")
    data = data_files_beside(pte)  # the base's and each adapter's, present and the ones exported
    cfg = m.config
    name = f"{cfg['model']['name']}-{cfg['quant']['name']}-{cfg['backend']['name']}-{m.program.sha256[:12]}"
    out = out or run_dir / "release"
    check_writable(out, "the bundle folder", "Choose a folder you can write: out=<dir>.")
    bundle = out / name
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)
    swapped = [entry.file for entry in m.swappable.adapters.values()] if m.swappable else []
    for file in (pte.name, *(p.name for p in data), *BUNDLED, *swapped):
        if (run_dir / file).is_file():
            (bundle / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / file, bundle / file)
    (bundle / "README.md").write_text(_readme(name, m))
    files = {str(p.relative_to(bundle)): {"sha256": sha256_of(p), "size_bytes": p.stat().st_size}
             for p in sorted(bundle.rglob("*")) if p.is_file()}
    if files[pte.name]["sha256"] != m.program.sha256:
        raise UserError(f"{pte} no longer matches the sha256 its manifest recorded.")
    full = m.to_dict()
    bundle_manifest = {
        "bundle": name,
        "model": {**full["model"], "id": cfg["model"].get("checkpoint") or cfg["model"]["name"]},
        "quant": full["quantization"], "backend": cfg["backend"]["name"],
        "methods": full["methods"], "layout": full["layout"], "constant_methods": m.constant_methods,
        "validation": {k: v for k, v in (full["validation"] or {}).items() if k != "per_window"},
        "data": full["data"], "adapters": full["adapters"], "swappable": full.get("swappable"),
        "runtime": full["runtime"], "bench": full["bench"],
        "versions": m.versions, "config": cfg, "files": files,
        **({"vision": full["components"]["vision"]["vision"]} if "vision" in full["components"] else {}),
    }
    (bundle / MANIFEST_FILE).write_text(json.dumps(bundle_manifest, indent=2) + "\n")
    archive = out / f"{name}.tar.gz"
    archive.write_bytes(_deterministic_tar_gz(bundle))
    return bundle, archive


def _deterministic_tar_gz(folder: Path) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):  # adapters/<name>.ptd too
            info = tar.gettarinfo(str(path), arcname=f"{folder.name}/{path.relative_to(folder)}")
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    return gzip.compress(raw.getvalue(), mtime=0)


def verify_bundle(path: Path) -> list[str]:
    """Problems found in a bundle folder or archive (empty when every file matches its sha256)."""
    if path.is_file() and path.name.endswith(".tar.gz"):
        import tempfile

        with tempfile.TemporaryDirectory() as tmp, tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
            folders = [p for p in Path(tmp).iterdir() if p.is_dir()]
            if len(folders) != 1:
                return [f"{path}: expected one bundle folder inside, found {len(folders)}"]
            return verify_bundle(folders[0])
    manifest_file = path / MANIFEST_FILE
    if not manifest_file.is_file():
        return [f"{path}: no {MANIFEST_FILE}; not a bundle made by `python -m exporters.package`"]
    files = json.loads(manifest_file.read_text())["files"]
    problems = []
    for name, expected in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"missing: {name}")
        elif (actual := sha256_of(f)) != expected["sha256"]:
            problems.append(f"changed: {name} (sha256 {actual[:16]}..., manifest says {expected['sha256'][:16]}...)")
    extra = sorted(n for p in path.rglob("*") if p.is_file() and (n := str(p.relative_to(path))) not in files
                   and n != MANIFEST_FILE)
    problems += [f"not in the manifest: {name}" for name in extra]
    return problems
