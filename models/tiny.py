"""A tiny checkpoint (Llama by default, any supported family) built offline and deterministically:
the default model and the test fixture.

It is written as a real Hugging Face checkpoint directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``generation_config.json``) by transformers itself, so the default export goes
through exactly the loading path a user's checkpoint takes, and tests can compare against
transformers' ``LlamaForCausalLM`` on the same files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2

CORPUS = """\
Once upon a time there was a small language model that lived on a phone.
It read every word the user typed and guessed the next one, quickly and quietly.
The model was exported with ExecuTorch, quantized to four bits, and shipped in an app.
Engineers measured its speed in tokens per second and its size in megabytes.
A good export is one that runs, that matches the original model, and that fits in memory.
The cache holds the keys and values of every token the model has already seen.
Prefill reads the whole prompt at once; decode adds one token at a time.
Hello world! How are you today? I am fine, thank you. What is the weather like?
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } - _ + = / \\ * & % $ # @
"""

DEFAULT_ARCH: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 384,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "initializer_range": 0.02,
}


def train_tokenizer(vocab_size: int, corpus: str = CORPUS) -> Any:
    """A byte-level BPE tokenizer trained on ``corpus`` (deterministic: same input, same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return tok


def train_sentencepiece(vocab_size: int, corpus: str = CORPUS) -> bytes:
    """A SentencePiece BPE model (``tokenizer.model``, byte fallback) trained on ``corpus``."""
    import io

    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines()), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1, character_coverage=1.0,
        hard_vocab_limit=False, minloglevel=2, num_threads=1,
    )
    return buf.getvalue()


def fit_to_corpus(model: torch.nn.Module, ids: list[int], steps: int, seed: int, window: int = 32) -> None:
    """A few seconds of training on the corpus, so the tiny model has peaked, input-dependent logits.

    Purely random weights give either a model that repeats one token (small init) or a chaotic one
    whose activations amplify rounding (large init); neither exercises validation like a real model.
    """
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    marks = {steps * k // 4 for k in range(1, 4)}
    for step in range(steps):
        if step in marks:
            log.info("  load: training the tiny model, step %d/%d", step, steps)
        starts = torch.randint(0, len(data) - window - 1, (8,), generator=gen)
        batch = torch.stack([data[s:s + window] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def cache_dir() -> Path:
    """Where trained tiny checkpoints are kept between runs: ``$LLM_EXPORTERS_CACHE/tiny``, else
    ``$XDG_CACHE_HOME/llm-exporters/tiny`` (``~/.cache``)."""
    from models.gguf import llm_exporters_cache

    return llm_exporters_cache() / "tiny"


def recipe_key(**recipe: Any) -> str:
    """What decides a tiny checkpoint's bytes: the recipe, this module's code, and the libraries that train it
    (training is deterministic on the CPU whatever the thread count: checked)."""
    versions = {name: metadata.version(name) for name in ("torch", "transformers", "tokenizers", "sentencepiece")}
    text = json.dumps({"recipe": recipe, "versions": versions}, sort_keys=True, default=str).encode()
    return hashlib.sha256(text + Path(__file__).read_bytes()).hexdigest()[:20]


def write_tiny_checkpoint(out_dir: str | Path, arch: dict[str, Any] | None = None, seed: int = 0,
                          family: str = "llama", train_steps: int = 150, tokenizer: str = "bpe") -> Path:
    """Write a seeded checkpoint of ``family`` (a key of ``FAMILIES``) to ``out_dir``, briefly fitted to
    ``CORPUS``. ``train_steps=0`` keeps the random initialisation. ``tokenizer="sentencepiece"`` writes
    a ``tokenizer.model`` (as Llama 2 / Gemma ship) instead of a byte-level BPE ``tokenizer.json``.

    The training runs once per recipe: its files are kept in :func:`cache_dir` and copied from there (every tiny
    export and sweep job would otherwise train again, most of a tiny export's time).
    """
    key = recipe_key(arch=arch or {}, seed=seed, family=family, train_steps=train_steps, tokenizer=tokenizer)
    return built_once(key, lambda out: _train_tiny_checkpoint(out, arch, seed, family, train_steps, tokenizer),
                      Path(out_dir))


def built_once(key: str, build: Callable[[Path], Path], out: Path) -> Path:
    """``build(folder)``'s files copied to ``out``, built once per ``key`` (:func:`recipe_key`) into :func:`cache_dir`
    (complete or absent: a reader never sees half a checkpoint); without a writable cache, built into ``out``."""
    from filelock import FileLock

    cache = cache_dir()
    cached = cache / key
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(str(cache / f"{key}.lock")):
            if not cached.is_dir():
                started = time.perf_counter()
                log.info("  load: training a tiny model for this recipe (once: later exports copy it from %s) ...",
                         cached)
                staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{key}."))
                try:
                    build(staging)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
                os.replace(staging, cached)
                log.info("  load: tiny model trained in %.1f s", time.perf_counter() - started)
    except OSError:  # no writable cache (a read-only home): build into the run folder itself
        return build(out)
    shutil.copytree(cached, out, dirs_exist_ok=True)
    return out


def _train_tiny_checkpoint(out_dir: Path, arch: dict[str, Any] | None, seed: int, family: str, train_steps: int,
                           tokenizer: str) -> Path:
    import transformers
    from transformers import AutoConfig, GenerationConfig

    from models.families import FAMILIES

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    given = {**DEFAULT_ARCH, **(arch or {})}
    scaled = FAMILIES[family].tiny_arch  # fields whose transformers defaults are a published model's size
    arch = {**(scaled(given["vocab_size"]) if scaled else {}), **given}
    if "rope_parameters" in arch:  # it carries its own rope_theta (per layer type for Gemma 3)
        arch.pop("rope_theta")
    if tokenizer == "sentencepiece":
        import sentencepiece

        sp_model = train_sentencepiece(arch["vocab_size"])
        corpus_ids = list(sentencepiece.SentencePieceProcessor(model_proto=sp_model).Encode(CORPUS))
    else:
        bpe = train_tokenizer(arch["vocab_size"])
        corpus_ids = bpe.encode(CORPUS).ids
    architecture = FAMILIES[family].architectures[0]
    config = AutoConfig.for_model(
        FAMILIES[family].model_type, **arch, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=None,
        architectures=[architecture],
    )
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    if train_steps:
        fit_to_corpus(model, corpus_ids, train_steps, seed)
    with torch.no_grad():  # Gemma 4's stored per-layer scalars start at 1, where a missing multiply would not show
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.eval().save_pretrained(out)
    GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID).save_pretrained(out)
    if tokenizer == "sentencepiece":
        (out / "tokenizer.model").write_bytes(sp_model)
    else:
        bpe.save(str(out / "tokenizer.json"))
    tokenizer_class = "LlamaTokenizer" if tokenizer == "sentencepiece" else "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", '
        f'"tokenizer_class": "{tokenizer_class}", "model_max_length": 2048}}\n'
    )
    return out


def write_tiny_gemma4_assistant(out_dir: str | Path, target: str | Path, seed: int = 0, hidden_size: int = 32,
                                ordered: bool = False, centroids: int | None = None, top_k: int = 2) -> Path:
    """A random Gemma 4 assistant (``models.gemma4_drafter``) for the Gemma 4 checkpoint ``target``: one layer of each
    of the target's layer types with the target's head sizes and kv heads, ``hidden_size`` wide, written by
    transformers itself. ``ordered``: with the centroid head (``use_ordered_embeddings``, 4 clusters, 2 kept), its
    token order a seeded permutation; its clusters ``centroids``, else the divisor of the vocabulary nearest 8 (a
    prime vocabulary's clusters are single tokens), ``top_k`` of them kept. Random weights propose nothing the target
    accepts often: parity and cost only."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    from models.gemma4_drafter import assistant_buildable

    t = json.loads((Path(target) / "config.json").read_text())
    t = t.get("text_config", t)  # as stored: transformers' config object refuses per-layer fields read model-wide
    kinds = list(dict.fromkeys(t["layer_types"]))
    copied = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attention_k_eq_v",
              "sliding_window", "rope_parameters", "final_logit_softcapping", "rms_norm_eps")
    # Each layer's head size and kv heads: those of the target's first layer of its type (stored per layer).
    stored = {int(k): c for k, c in t.get("per_layer_config", {}).items()}  # keys "4" or "04", as many layers have
    per_layer = {str(i): stored.get(t["layer_types"].index(kind), {}) for i, kind in enumerate(kinds)}
    text = {"model_type": "gemma4_text", "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": len(kinds), "layer_types": kinds, "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0, "tie_word_embeddings": True, **{k: t[k] for k in copied if k in t},
            "per_layer_config": {i: c for i, c in per_layer.items() if c}}
    vocab = t["vocab_size"]
    centroids = centroids or min((d for d in range(2, vocab + 1) if vocab % d == 0), key=lambda d: abs(d - 8))
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=t["hidden_size"],
                                   use_ordered_embeddings=ordered, num_centroids=centroids,
                                   centroid_intermediate_top_k=top_k,
                                   architectures=["Gemma4AssistantForCausalLM"])
    torch.manual_seed(seed)
    with assistant_buildable():
        model = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(t["vocab_size"]))
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def write_tiny_gemma4_pair(out_dir: str | Path) -> tuple[Path, Path]:
    """A tiny Gemma 4 (``target/``, fitted to the corpus, with KV sharing) and a random assistant for it
    (``assistant/``): what ``draft.checkpoint=<assistant>`` exports beside its target, offline."""
    out = Path(out_dir)
    arch = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
            "num_kv_shared_layers": 2, "sliding_window": 16}
    target = write_tiny_checkpoint(out / "target", arch=arch, family="gemma4")
    return target, write_tiny_gemma4_assistant(out / "assistant", target)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write tiny checkpoints built offline by transformers itself.")
    parser.add_argument("what", choices=["gemma4-pair"], help="gemma4-pair: a tiny Gemma 4 and a Gemma 4 assistant "
                                                              "for it, in <out>/target and <out>/assistant")
    parser.add_argument("out", help="the folder to write")
    args = parser.parse_args()
    for folder in write_tiny_gemma4_pair(args.out):
        print(folder)


if __name__ == "__main__":
    main()
