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

from exporters.components import KINDS, Bundled
from exporters.program.versions import STOCK_RUNNER_RELEASES
from exporters.errors import UserError
from exporters.output.folder import check_writable
from exporters.output.files import sha256_of
from exporters.manifest import MANIFEST_FILE, Manifest, ValidationReport
from exporters.program.weights import data_files_beside
from models.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILES

BUNDLED = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", CHAT_TEMPLATE_FILE, "generation_config.json")


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


def _validation_text(v: ValidationReport | None) -> str:
    if v is None:
        return "Not validated (exported with validate=false)."
    return (f"Run in the ExecuTorch runtime ({v.checked}) against the eager model on {v.scored_tokens} tokens of "
            f"{v.text}: mean KL divergence {v.kl_mean}, greedy agreement {v.top1_agreement}. Quality: {v.quality()}.")


def _readme(name: str, m: Manifest, bundled: list[Bundled]) -> str:
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
context {m.constant_methods.get('get_max_context_len', m.constant_methods.get('get_max_seq_len'))} tokens, at most
{max(e.tokens[1] for e in m.methods.values())} per call.

## Run it

{next((b.run for b in bundled if b.run), None) or _how_to_run(m, tokenizer)}

## Methods

| method | inputs | outputs |
|---|---|---|
{rows}

## Constant methods

| method | value |
|---|---|
{constants}

{_context_text(m)}{"".join(b.readme for b in bundled)}## Validation

{next((b.validation for b in bundled if b.validation), None) or _validation_text(m.validation)}

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
    bundled = [kind.bundle(m) for kind in KINDS.values()]  # what each kind of model the program holds adds
    for file in (pte.name, *(p.name for p in data), *BUNDLED, *(f for b in bundled for f in b.files)):
        if (run_dir / file).is_file():
            (bundle / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / file, bundle / file)
    (bundle / "README.md").write_text(_readme(name, m, bundled))
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
        "runtime": full["runtime"], "kv_cache": full.get("kv_cache"), "bench": full["bench"],
        "versions": m.versions, "config": cfg, "files": files,
        **{k: v for b in bundled for k, v in b.fields.items()},
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
