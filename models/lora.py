"""PEFT LoRA adapters on our decoder: read a folder PEFT saved, check it fits the base, attach it with PEFT.

A LoRA adapter adds ``scale * B(A(x))`` to the output of each linear layer it targets (PEFT's ``LoraLayer``),
``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), r and alpha per layer from
``rank_pattern`` / ``alpha_pattern``. Our decoder names its modules as Hugging Face does
(``model.layers.0.self_attn.q_proj``), so PEFT's own ``inject_adapter_in_model`` and
``set_peft_model_state_dict`` attach a saved adapter to it unchanged: the math is PEFT's, not a copy of it.

Several adapters live side by side in one model; :func:`active_adapter` selects one (or none: the base) for
the next calls, which is how each adapter's methods are captured from the same module and share its base
weights. Everything a folder could get wrong is checked by :func:`read_adapter` before any long stage.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from models.errors import ModelError

if TYPE_CHECKING:
    from models.decoder import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved keys: base_model.model.<module path>.lora_A.weight / .lora_B.weight.
KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
ADAPTER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
# LoraConfig fields that change what the adapter computes in ways we do not export, with what they are; each
# must be at its default. (lora_dropout and init_* only matter in training.)
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (a learned magnitude per output)"),
    "lora_bias": (False, "a bias on lora_B"),
    "bias": ("none", "trained biases of the base layers"),
    "modules_to_save": (None, "fully trained copies of whole modules"),
    "trainable_token_indices": (None, "trained embedding rows"),
    "fan_in_fan_out": (False, "transposed (Conv1D) base weights"),
    "layer_replication": (None, "replicated layers"),
    "alora_invocation_tokens": (None, "activated LoRA (applied after invocation tokens only)"),
    "use_qalora": (False, "QA-LoRA (pooled inputs)"),
    "target_parameters": (None, "LoRA on parameters rather than modules"),
}


class AdapterError(ModelError):
    """An adapter folder that cannot be exported with this base."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter as read from its folder: what it targets, with which rank and scale, and its weights."""

    name: str
    folder: Path
    config: Any  # peft.LoraConfig
    state_dict: dict[str, torch.Tensor]  # PEFT's saved keys
    modules: dict[str, int]  # targeted module path -> its rank

    @property
    def matrices(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (A [r, in], B [out, r])."""
        return _by_module(self.name, self.folder, self.state_dict)

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.modules.values()))

    @property
    def targets(self) -> list[str]:
        """The kinds of layer it changes (q_proj, v_proj, ...)."""
        return sorted({path.rsplit(".", 1)[-1] for path in self.modules})

    def describe(self) -> str:
        return (f"{self.name}: LoRA r={'/'.join(map(str, self.ranks))}, alpha {self.config.lora_alpha}"
                f"{' (rsLoRA)' if self.config.use_rslora else ''} on {len(self.modules)} layers "
                f"({', '.join(self.targets)})")


def _fail(name: str, folder: Path, problem: str, fix: str) -> AdapterError:
    return AdapterError(f"model.adapters.{name}={folder}: {problem}. {fix} Nothing was exported.")


def check_adapter_names(names: list[str]) -> None:
    """Adapter names become method-name prefixes (``<adapter>_prefill``): letters and digits, so the first ``_``
    of a method's name ends the adapter's."""
    for name in names:
        if not ADAPTER_NAME.match(name):
            raise AdapterError(
                f"model.adapters: the adapter name {name!r} cannot name methods: use letters and digits, starting "
                "with a letter (e.g. +model.adapters={chat: /path/to/adapter}). Nothing was exported.")


def _read_config(name: str, folder: Path) -> Any:
    from peft import LoraConfig, PeftType

    path = folder / CONFIG_FILE
    if not folder.is_dir() or not path.is_file():
        raise _fail(name, folder, f"no {CONFIG_FILE} there" if folder.is_dir() else "no such folder",
                    "Give the folder PeftModel.save_pretrained wrote (adapter_config.json + "
                    "adapter_model.safetensors).")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise _fail(name, folder, f"{CONFIG_FILE} is not valid JSON ({error})", "Save the adapter again.") from error
    peft_type = raw.get("peft_type")
    if peft_type != PeftType.LORA:
        raise _fail(name, folder, f"it is a {peft_type or 'unknown'} adapter, not LoRA",
                    "Only LoRA adapters (peft_type LORA) become methods; merge other kinds into the checkpoint.")
    try:
        config = LoraConfig.from_pretrained(str(folder))
    except (TypeError, ValueError) as error:
        raise _fail(name, folder, f"PEFT cannot read its {CONFIG_FILE} ({error})", "Save the adapter again.") from error
    for field_name, (default, what) in UNSUPPORTED_FIELDS.items():
        value = getattr(config, field_name, default)
        if value not in (default, [], {}, None) or (default is None and value):
            raise _fail(name, folder, f"{field_name}={value!r} ({what}) is not supported",
                        f"Export adapters trained without {field_name}, or merge this one into the checkpoint "
                        "(PeftModel.merge_and_unload) and export the merged model.")
    return config


def _read_weights(name: str, folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / WEIGHTS_FILE
    if not path.is_file():
        bin_file = folder / "adapter_model.bin"
        raise _fail(name, folder, f"no {WEIGHTS_FILE}" + (" (only adapter_model.bin)" if bin_file.is_file() else ""),
                    "Save the adapter with safe_serialization=True (PEFT's default).")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise _fail(name, folder, f"{WEIGHTS_FILE} cannot be read ({error})",
                    "The file is damaged or incomplete: copy or save it again.") from error


def check_adapter_overrides(overrides: list[str]) -> None:
    """Two adapters of one name on the command line (``+model.adapters={a: x, a: y}``): Hydra keeps the last one
    without a word, so the command-line text itself is read."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") != "model.adapters":
            continue
        names = re.findall(r"(?:^|[{,])\s*['\"]?([^\s:'\",{}]+)['\"]?\s*:", value)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise AdapterError(f"model.adapters names {', '.join(repeated)} more than once ({override}): each adapter "
                               "needs its own name, which becomes its methods' prefix. Rename one. Nothing was exported.")


def check_adapter_folders(adapters: dict[str, str]) -> None:
    """What can be checked without the model (names, files, the config's type and fields): before any work."""
    check_adapter_names(list(adapters))
    for name, folder in adapters.items():
        path = Path(folder).expanduser()
        _read_config(name, path)
        if not (path / WEIGHTS_FILE).is_file():
            _read_weights(name, path)  # raises, saying what is there instead


def _by_module(name: str, folder: Path,
               weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's saved keys -> module path: (A [r, in], B [out, r]); refuses anything else a folder may hold."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = KEY.match(key)
        if match is None:
            raise _fail(name, folder, f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA A/B matrix of a linear layer",
                        "Only lora_A / lora_B weights of linear layers are supported (no embeddings, biases, DoRA "
                        "magnitudes or saved modules).")
        found.setdefault(match["module"], {})[match["part"]] = tensor
    if not found:
        raise _fail(name, folder, f"{WEIGHTS_FILE} holds no LoRA weights", "Save the adapter again.")
    for path, parts in found.items():
        if set(parts) != {"A", "B"}:
            raise _fail(name, folder, f"{path} has lora_{''.join(parts)} but not both A and B",
                        "Save the adapter again.")
    return {path: (parts["A"], parts["B"]) for path, parts in found.items()}


def read_peft_folder(name: str, folder: str | Path) -> tuple[Any, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT LoRA folder without a model to check it against: its config and its (A, B) per module path (what
    ``models.lora_slots.pack`` lays out for a program's slots, which check the shapes)."""
    folder = Path(folder).expanduser()
    config = _read_config(name, folder)
    return config, _by_module(name, folder, _read_weights(name, folder))


def _decoder_keys(weights: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """An adapter saved on a multimodal model: the keys of its decoder's modules (under one of ``prefixes``, e.g.
    ``model.language_model.``) as our decoder names them (``model.``)."""
    def renamed(key: str) -> str:
        module = key.removeprefix("base_model.model.")
        found = next((p for p in prefixes if module.startswith(p)), None)
        return key if found is None else "base_model.model.model." + module.removeprefix(found)
    return {renamed(k): v for k, v in weights.items()}


def read_adapter(name: str, folder: str | Path, model: CausalLM, prefixes: tuple[str, ...] = ()) -> LoraAdapter:
    """Read and check one PEFT LoRA folder against ``model`` (our decoder, unquantized); ``prefixes``: where the
    decoder's modules are in the adapter's keys when it was saved on a multimodal model (:func:`_decoder_keys`)."""
    from peft.utils.other import get_pattern_key

    folder = Path(folder).expanduser()
    config = _read_config(name, folder)
    weights = _decoder_keys(_read_weights(name, folder), prefixes)
    found = _by_module(name, folder, weights)
    if "lm_head" in found:
        raise _fail(name, folder, "it adapts lm_head", "Adapters on the output projection are not supported (it may be "
                    "the embedding matrix itself, stored once): merge this adapter into the checkpoint instead.")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"}
    missing = sorted(path for path in found if path not in linears)
    if missing:
        kinds = sorted({p.rsplit(".", 1)[-1] for p in linears})
        raise _fail(name, folder, f"it targets {len(missing)} module(s) the base does not have, e.g. {missing[0]}",
                    f"It was trained for another architecture; this base's decoder layers have the linear layers "
                    f"{', '.join(kinds)}. Train the adapter on this base.")
    modules: dict[str, int] = {}
    for path, (a, b) in sorted(found.items()):
        layer = model.get_submodule(path)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != layer.in_features or b.shape != (layer.out_features, r):
            raise _fail(name, folder,
                        f"its {path} matrices are A {list(a.shape)}, B {list(b.shape)}; this base's layer is "
                        f"{layer.out_features} x {layer.in_features}, which needs A [r, {layer.in_features}] and "
                        f"B [{layer.out_features}, r]", "The adapter was trained for another base model of the "
                        "same family (another size): train it on this base.")
        ranks = config.rank_pattern or {}
        declared = ranks.get(get_pattern_key(ranks.keys(), path), config.r)
        if declared != r:
            raise _fail(name, folder, f"{CONFIG_FILE} gives {path} rank {declared}, its weights have rank {r}",
                        "The config and the weights are from different adapters: save the adapter again.")
        modules[path] = r
    return LoraAdapter(name, folder, config, weights, modules)


def attach_adapters(model: CausalLM, adapters: list[LoraAdapter]) -> None:
    """Inject every adapter into ``model`` with PEFT (its layers wrap our linears) and load its weights.

    Each adapter targets exactly the modules its weights name (PEFT's ``state_dict`` targeting), whatever its
    ``target_modules`` pattern says. Afterwards no adapter is active: the model computes the base.
    """
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    for adapter in adapters:
        weights = {k.removeprefix("base_model.model."): v for k, v in adapter.state_dict.items()}
        inject_adapter_in_model(adapter.config, model, adapter_name=adapter.name, state_dict=weights)
        result = set_peft_model_state_dict(model, weights, adapter_name=adapter.name)
        unexpected = [k for k in result.unexpected_keys if adapter.name in k or "lora_" in k]
        if unexpected:
            raise AdapterError(f"model.adapters.{adapter.name}: PEFT did not load {unexpected[:3]}: an internal "
                               "mismatch between read_adapter and PEFT; please report it.")
    _select(model, None)


def lora_layers(model: nn.Module) -> list[Any]:
    """PEFT's LoRA layers in ``model``. None where PEFT was never imported: no model here can hold one then, and an
    export without adapters does not pay PEFT's import (about 1.5 s) to find that out."""
    if "peft.tuners.lora" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def _select(model: nn.Module, name: str | None) -> None:
    for layer in lora_layers(model):
        if name is None or name not in layer.lora_A:
            layer.enable_adapters(False)
        else:
            layer.enable_adapters(True)
            layer.set_adapter(name)


@contextlib.contextmanager
def active_adapter(model: nn.Module, name: str | None) -> Iterator[None]:
    """Within the block the model computes with adapter ``name`` (None: the base model); the base after it."""
    _select(model, name)
    try:
        yield
    finally:
        _select(model, None)


def is_adapter_module(fqn: str) -> bool:
    """Whether a module path is inside an adapter (PEFT's lora_A / lora_B), which quantization leaves alone."""
    return ".lora_A." in fqn or ".lora_B." in fqn or fqn.endswith((".lora_A", ".lora_B"))


# PEFT's module path of an adapter's weights: <layer>.lora_A.<adapter>.weight (quantized: ...weight.original0).
ADAPTER_PARAMETER = re.compile(r"\.lora_[AB]\.(?P<adapter>[A-Za-z][A-Za-z0-9]*)\.")


def adapter_of_parameter(fqn: str) -> str | None:
    """The adapter a parameter belongs to (its name in ``model.adapters``), None for the base's own."""
    found = ADAPTER_PARAMETER.search(fqn)
    return found.group("adapter") if found else None
