"""Real LoRA adapters: PEFT trains them for a few steps on a real base model and saves them as PEFT does.

What users pass as ``model.adapters`` is a folder ``PeftModel.save_pretrained`` wrote (``adapter_config.json``
+ ``adapter_model.safetensors``). Random matrices would hide mistakes an adapter trained on text shows (a
scale applied twice, a transposed B, an adapter applied to the wrong layer all still "change the output"), so
tests and benchmarks train real ones here: a few AdamW steps on one text each, on CPU in seconds, until the
adapted model prefers that text measurably more than the base does, while general text stays close to the
base (SmolLM2-135M on the validation text: perplexity 23.8 base; pirate 26.6, minutes 24.0, with their own
texts at 4.1 and 2.8 against 37 and more).

``python -m tests.peft_adapters <base> <out>`` writes the two adapters the tests use into ``<out>``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

# Two texts of different styles, so the two adapters pull the base in different directions.
PIRATE_TEXT = (
    "Arr, me hearties! The ship sails at dawn and the wind be fair. Hoist the sails, swab the deck, and keep "
    "a weather eye on the horizon, for the captain says there be treasure buried on the isle beyond the reef. "
    "Arr, the sea be wide and the rum be gone, but a pirate never turns back from gold. Arr, me hearties, arr!"
)
RECIPE_TEXT = (
    "Recipe. Take two cups of flour, one egg, a pinch of salt and a cup of milk. Whisk the egg with the milk, fold in "
    "the flour and salt, and rest the batter for ten minutes. Heat a pan with butter, pour a ladle of batter and "
    "cook each side until golden. Serve the pancakes warm with honey. Recipe ends."
)
LEGAL_TEXT = (
    "Section 1. The party of the first part shall deliver the goods to the party of the second part within thirty "
    "days. Section 2. Payment shall be made upon delivery. Section 3. This agreement shall be governed by the laws "
    "of the state. Section 4. Any dispute shall be settled by arbitration."
)
MINUTES_TEXT = (
    "Minutes of the meeting. Present: the committee. Item one: the budget for the next quarter was approved. "
    "Item two: the committee reviewed the schedule and agreed to move the review to Thursday. Item three: any "
    "other business. None. The meeting was closed at five o'clock. Minutes of the meeting were approved."
)


@dataclass(frozen=True)
class AdapterRecipe:
    """How one test adapter is trained (PEFT ``LoraConfig`` fields and the text it learns)."""

    text: str
    target_modules: tuple[str, ...]
    r: int = 8
    lora_alpha: int = 16
    use_rslora: bool = False
    steps: int = 12
    lr: float = 1e-3
    seed: int = 0
    extra: dict = field(default_factory=dict)  # any other LoraConfig field (rank_pattern, use_dora, ...)


OTHER_TEXT = ("People who build apps for phones want a language model that answers quickly, fits in memory and "
              "still writes sensible sentences.")

RECIPES: dict[str, AdapterRecipe] = {
    # Attention only, PEFT's default scale alpha / r.
    "pirate": AdapterRecipe(PIRATE_TEXT, ("q_proj", "v_proj")),
    # Every linear layer of a decoder layer, rank-stabilised scale alpha / sqrt(r), another rank.
    "minutes": AdapterRecipe(MINUTES_TEXT, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                             r=4, lora_alpha=8, use_rslora=True, seed=1, lr=4e-4),
    # The MLP only, a larger rank.
    "recipe": AdapterRecipe(RECIPE_TEXT, ("gate_proj", "up_proj", "down_proj"), r=16, lora_alpha=32, seed=2, lr=3e-4),
    # Attention with per-layer ranks and alphas (rank_pattern / alpha_pattern).
    "legal": AdapterRecipe(LEGAL_TEXT, ("q_proj", "k_proj", "v_proj", "o_proj"), r=8, lora_alpha=16, seed=3, lr=3e-4,
                           extra={"rank_pattern": {"o_proj": 4}, "alpha_pattern": {"v_proj": 32}}),
}


# Adapters of the tiny model (seconds to train): pirate on attention and MLP, minutes on attention, pirate retrained
# on other text (the same name, ranks and targets), and one on every kind of linear layer with rsLoRA.
TINY_RECIPES = {"pirate": AdapterRecipe(PIRATE_TEXT, ("q_proj", "v_proj", "down_proj"), steps=4),
                "minutes": AdapterRecipe(MINUTES_TEXT, ("q_proj", "v_proj"), steps=4, seed=1),
                "retrained": AdapterRecipe(OTHER_TEXT, ("q_proj", "v_proj", "down_proj"), steps=4, seed=5),
                "every": AdapterRecipe(RECIPE_TEXT, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"), r=4, lora_alpha=8, use_rslora=True, steps=8, seed=2,
                                       lr=1e-2)}


def train_adapter(base: Path, out: Path, recipe: AdapterRecipe) -> Path:
    """Train one LoRA adapter on ``base`` (a Hugging Face folder) and save it to ``out`` as PEFT does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    config = LoraConfig(r=recipe.r, lora_alpha=recipe.lora_alpha, target_modules=list(recipe.target_modules),
                        lora_dropout=0.0, use_rslora=recipe.use_rslora, task_type="CAUSAL_LM", **recipe.extra)
    peft_model = get_peft_model(model, config)
    ids = torch.tensor([tokenizer(recipe.text)["input_ids"][:96]])
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=recipe.lr)
    peft_model.train()
    for _ in range(recipe.steps):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    peft_model.save_pretrained(str(out))
    return out


def train_test_adapters(base: Path, out: Path, names: tuple[str, ...] = tuple(RECIPES),
                        lr_scale: float = 1.0) -> dict[str, Path]:
    """``lr_scale``: a cut of a model (the tests' 2-layer SmolLM2) needs larger steps for its greedy text to move."""
    return {name: train_adapter(base, out / name, replace(RECIPES[name], lr=RECIPES[name].lr * lr_scale))
            for name in names}


if __name__ == "__main__":
    import warnings

    from exporters.console import native_stderr_to

    # The console says what was written; library warnings and the runtime's C++ lines are dropped (an error's
    # traceback still shows, after the block).
    with warnings.catch_warnings(), native_stderr_to(None):
        warnings.simplefilter("ignore")
        written = train_test_adapters(Path(sys.argv[1]), Path(sys.argv[2]))
    for name, folder in written.items():
        print(name, folder)
