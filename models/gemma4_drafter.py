"""Gemma 4's assistant (``Gemma4AssistantForCausalLM``, the "MTP drafter"): a small decoder that proposes the target's
next tokens from the target's own state, with no cache of its own.

What one proposal reads (transformers' ``Gemma4AssistantCandidateGenerator``, 5.23): the target's scaled embedding of
the last token beside the target's final normed hidden state one position before it (the state whose logits chose
that token), projected to the drafter's width (``pre_projection``); its layers attend over the keys and values of
the target's last caching layer of their type, at the last token's position ``p`` (RoPE) and seeing what a query at
``p - 1`` sees (positions before ``p``; a sliding layer its window). Each further proposal of the round feeds the
proposed token's embedding beside the drafter's own ``post_projection`` of its last hidden state, at the same ``p``.

Here the target keeps each position's final hidden state (``DecoderArgs.keeps_final_hidden``) and the drafter's
layers are bound to the target's caches (:meth:`Gemma4Drafter.bind`), so proposing needs nothing but the last token
and its position, from any state the target is in: after a prompt, after a verify that kept some proposals.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import torch
from torch import nn

from models.checkpoint import load_weights, weight_files_of
from models.decoder import CausalLM, DecoderArgs
from models.errors import ModelError
from models.families import decoder_args

ARCHITECTURE = "Gemma4AssistantForCausalLM"


@contextlib.contextmanager
def assistant_buildable() -> Iterator[None]:
    """transformers 5.23.0 cannot build ``Gemma4AssistantForCausalLM``: its config makes every layer KV-shared, and
    ``Gemma4TextConfig.kv_sharing_modes`` then raises ("The set of layer types producing a cache is different than
    the set of layer types using them") while the layers are built. Within this block a config whose layers all
    share reads them all as "reuse", which is what the assistant's modeling file expects (its layers read
    ``shared_kv_states``). For the tiny checkpoints and the parity tests' reference; our loader does not need it."""
    from transformers import Gemma4TextConfig

    stock = Gemma4TextConfig.kv_sharing_modes

    def modes(config: Any) -> list[str | None]:
        if config.num_kv_shared_layers == config.num_hidden_layers:
            return ["reuse"] * config.num_hidden_layers
        return stock.fget(config)

    Gemma4TextConfig.kv_sharing_modes = property(modes)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        Gemma4TextConfig.kv_sharing_modes = stock  # type: ignore[method-assign]


class OrderedHead(nn.Module):
    """The assistant's centroid head (``use_ordered_embeddings``): the hidden state picks ``top_k`` of
    ``centroids`` clusters of the vocabulary (``token_ordering`` lists each cluster's tokens) and only their tokens
    are scored; transformers fills the others with the lowest score less one, so the best token is among them."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.per_centroid = top_k, vocab // centroids
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab, dtype=torch.int64))

    def best(self, h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The best token [1] of the hidden state ``h`` [1, hidden] under the head's rows ``table`` [vocab, hidden]."""
        chosen = torch.topk(self.centroids(h), self.top_k, dim=-1).indices.view(-1)  # [top_k]
        tokens = self.token_ordering.view(-1, self.per_centroid).index_select(0, chosen).view(-1)
        scores = (rows_of(table, tokens).to(h.dtype) @ h.view(-1, 1)).view(-1)
        return tokens.index_select(0, scores.argmax().view(1))


def rows_of(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``table``'s ``rows`` as floats. A matrix torchao quantized by groups of a row (``IntxUnpackedToInt8Tensor``: int8
    codes, a scale and zero point per group) gives its rows from theirs, ``(codes - zero) * scale``, without
    dequantizing the others (the centroid head reads 4096 of Gemma 4's 262144)."""
    codes = getattr(table, "qdata", None)
    if codes is None:
        return table.index_select(0, rows)
    if tuple(table.block_size)[0] != 1:
        raise ValueError(f"the head's matrix is quantized in blocks of {tuple(table.block_size)}: rows cannot be read "
                         "alone. Quantize it by groups of a row (the 8da4w and 8da8w presets do).")
    group = table.block_size[1]
    scale = table.scale.index_select(0, rows).repeat_interleave(group, dim=1)
    zero = table.zero_point.index_select(0, rows).repeat_interleave(group, dim=1)
    return (codes.index_select(0, rows).to(scale.dtype) - zero.to(scale.dtype)) * scale


class _Attends(NamedTuple):
    """What a drafter layer attends with: RoPE at the token's position, the query position the target's cache is
    read at (one before, for the kernel's causal bound), the mask over the cache's slots, and that position's slot."""

    rope: Any
    positions: torch.Tensor
    mask: torch.Tensor
    slots: torch.Tensor


class Gemma4Drafter(CausalLM):
    """The assistant as a decoder whose layers read the target's caches; ``propose`` gives greedy proposals.

    Its parameters are named as transformers names them (``model.layers.0.self_attn.q_proj``, ``pre_projection``,
    ``post_projection``, ``masked_embedding.centroids``), so the checkpoint loads 1:1."""

    def __init__(self, args: DecoderArgs, backbone_hidden: int, ordered: dict[str, int] | None = None) -> None:
        assert args.reads_other_caches
        super().__init__(args)
        self.pre_projection = nn.Linear(2 * backbone_hidden, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, backbone_hidden, bias=False)
        self.masked_embedding = (OrderedHead(args.hidden_size, args.vocab_size, **ordered)
                                 if ordered is not None else None)
        self.owners: tuple[int, ...] = ()  # per layer, the target layer whose cache it reads (bind)

    def bind(self, target: CausalLM) -> None:
        """Read ``target``'s caches from now on: each layer the last layer of its type (RoPE table and window) that
        keeps a cache of its own among the target's layers before its KV-sharing ones, as transformers' "store"
        layers; same head size, kv heads and cache geometry, or the pair is refused."""
        t = target.args
        if not t.keeps_final_hidden:
            raise ModelError("the target keeps no final hidden states (DecoderArgs.keeps_final_hidden): Gemma 4's "
                             "assistant starts each proposal from them")
        first_shared = next((i for i, j in enumerate(t.layer_kv_source) if j is not None), t.num_hidden_layers)
        store = {t.layer_rope[i]: i for i in range(first_shared)}
        owners = []
        for i, kind in enumerate(self.args.layer_rope):
            owner = store.get(kind)
            ours = (self.args.layer_head_dim[i], self.args.layer_kv_heads[i], self.args.layer_geometry[i])
            if owner is None or ours != (t.layer_head_dim[owner], t.layer_kv_heads[owner], t.layer_geometry[owner]):
                theirs = "none" if owner is None else (
                    f"layer {owner}'s head size {t.layer_head_dim[owner]}, {t.layer_kv_heads[owner]} kv heads")
                raise ModelError(
                    f"the assistant's layer {i} ({kind}, head size {ours[0]}, {ours[1]} kv heads) reads the target's "
                    f"last {kind} layer's cache, and the target has {theirs}: this assistant was made for another "
                    "Gemma 4. Give the assistant published with the target (google/gemma-4-e2b-it-assistant for "
                    "gemma-4-e2b-it).")
            self.model.layers[i].self_attn.read_cache_of(target.model.layers[owner].self_attn)
            owners.append(owner)
        if target.args.hidden_size * 2 != self.pre_projection.in_features:
            raise ModelError(f"the assistant was trained beside a target {self.pre_projection.in_features // 2} wide; "
                             f"this target is {target.args.hidden_size}. Give the assistant published with the target.")
        self.owners = tuple(owners)

    def step(self, x: torch.Tensor, inputs: list[_Attends]) -> tuple[torch.Tensor, torch.Tensor]:
        """One proposal from the projected input ``x`` [1, 1, hidden]: the normed hidden state [1, hidden] and its
        projection back to the target's width [1, 1, backbone] (the next step's input beside the proposal)."""
        for layer, these in zip(self.model.layers, inputs):
            x = layer(x, these.rope, these.positions, these.mask, these.slots)
        h = self.model.norm(x)
        return h.view(1, -1), self.post_projection(h)

    def best(self, h: torch.Tensor) -> torch.Tensor:
        """The greedy proposal [1] of the normed hidden state ``h`` [1, hidden]."""
        if self.masked_embedding is not None:
            return self.masked_embedding.best(h, self.lm_head.weight)
        return self.head(h).argmax(dim=-1)

    def attends(self, target: CausalLM, p: torch.Tensor) -> list[_Attends]:
        """What each layer attends with for a token at position ``p`` [1]: RoPE at ``p``; over the target's cache, what
        a query at ``p - 1`` sees, a sliding layer one position more than the target's window (transformers'
        assistant masks sliding layers with ``|q - kv| <= window``)."""
        before = (p - 1).clamp(min=0)
        dtype = self.activation_dtype()
        tables = self.rope_tables(p, dtype)  # the assistant's own RoPE; the masks are the target's caches'
        found = []
        for rope, owner in zip((tables[name] for name in self.args.layer_rope), self.owners):
            g = target.args.layer_geometry[owner]
            seen = g if g.window is None else dataclasses.replace(g, window=g.window + 1)
            found.append(_Attends(rope, before, seen.mask(before, dtype, target.cache_positions[:g.slots]),
                                  g.slot_of(before)))
        return found

    def step_input(self, target: CausalLM, token: torch.Tensor, p: torch.Tensor,
                    hidden: torch.Tensor | None = None) -> torch.Tensor:
        """A step's projected input [1, 1, hidden]: the target's embedding of ``token`` [1, 1] beside ``hidden``
        [1, 1, backbone] (None: the target's final hidden state at ``p - 1``, the round's first step)."""
        if hidden is None:
            hidden = target.final_hidden.index_select(0, (p - 1).clamp(min=0)).view(1, 1, -1)
        embedded = target.token_embeddings(token)
        return self.pre_projection(torch.cat([embedded, hidden.to(embedded.dtype)], dim=-1))

    def propose(self, target: CausalLM, token: torch.Tensor, input_pos: torch.Tensor, k: int) -> torch.Tensor:
        """``k`` greedy proposals [1, k] to follow ``token`` [1, 1] at ``input_pos`` [1], which the target has not
        seen yet (its cache and final hidden states hold the positions before it)."""
        p = input_pos[:1]
        inputs = self.attends(target, p)
        x = self.step_input(target, token, p)
        proposals = []
        for i in range(k):
            h, hidden = self.step(x, inputs)
            token = self.best(h).view(1, 1)
            proposals.append(token)
            if i + 1 < k:
                x = self.step_input(target, token, p, hidden)
        return torch.cat(proposals, dim=1)

    def logits_of(self, target: CausalLM, token: torch.Tensor, input_pos: torch.Tensor,
                  hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's logits [1, vocab] (every token scored, without the centroid head's selection) and projected
        state [1, 1, backbone], from ``token`` and ``hidden`` (None: the target's state before it): what the parity
        tests compare with transformers."""
        p = input_pos[:1]
        h, projected = self.step(self.step_input(target, token, p, hidden), self.attends(target, p))
        return self.head(h), projected

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise TypeError("Gemma4Drafter proposes for a target: call propose(target, token, input_pos, k)")


@contextlib.contextmanager
def proposing(target: CausalLM, drafter: Gemma4Drafter, k: int) -> Iterator[None]:
    """Within this block ``target(token [1, 1], input_pos [1])`` gives the drafter's ``k`` proposals [1, k]: how the
    program's method is captured from the target's module, so that it names the target's caches and final hidden
    states as the target's methods do (ExecuTorch shares a mutable buffer between the methods naming it alike); the
    drafter's own weights go under ``assistant.``."""
    target.add_module("assistant", drafter)
    target.forward = lambda tokens, input_pos: drafter.propose(target, tokens, input_pos, k)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del target.forward
        del target._modules["assistant"]


def is_assistant_folder(path: str | Path) -> bool:
    """``path`` is a Hugging Face folder whose config.json names Gemma 4's assistant (read as JSON, no transformers)."""
    import json

    config = Path(path).expanduser() / "config.json"
    try:
        found = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in (found.get("architectures") or []) or found.get("model_type") == "gemma4_assistant"


def drafter_args(hf_config: Any, target: DecoderArgs) -> DecoderArgs:
    """The assistant's decoder arguments: its text config read by the Gemma 4 adapter as a model without KV sharing,
    then every layer reading another model's cache, with the target's cache shape and attention."""
    text = copy.deepcopy(hf_config.text_config)
    text.num_kv_shared_layers = 0  # the adapter's KV-sharing map would refuse a model that shares every layer
    text.architectures = ["Gemma4ForCausalLM"]
    args = decoder_args(text, target.max_context_len, source="the assistant's config.json", family="gemma4")
    return dataclasses.replace(args, reads_other_caches=True, attention=target.attention, kv_dtype=target.kv_dtype,
                               attention_sink=target.attention_sink, call_tokens=target.call_tokens,
                               final_logit_softcap=None)  # the assistant's logits are not soft-capped


def load_drafter(path: str | Path, target: CausalLM) -> Gemma4Drafter:
    """The assistant in ``path`` (a Hugging Face folder), its weights loaded and bound to ``target``'s caches."""
    from transformers import AutoConfig

    folder = Path(path)
    if not is_assistant_folder(folder):
        raise ModelError(f"{folder}: config.json names no Gemma 4 assistant ({ARCHITECTURE}); give e.g. "
                         "google/gemma-4-e2b-it-assistant.")
    hf_config = AutoConfig.from_pretrained(folder)
    args = drafter_args(hf_config, target.args)
    ordered = ({"centroids": hf_config.num_centroids, "top_k": hf_config.centroid_intermediate_top_k}
               if hf_config.use_ordered_embeddings else None)
    if ordered is not None and (args.vocab_size % ordered["centroids"] or ordered["top_k"] > ordered["centroids"]):
        raise ModelError(f"{folder}/config.json: num_centroids={ordered['centroids']} must divide the vocabulary "
                         f"({args.vocab_size}) and centroid_intermediate_top_k={ordered['top_k']} may not exceed it. "
                         "The config is damaged: re-download it.")
    with torch.device("meta"):
        drafter = Gemma4Drafter(args, hf_config.backbone_hidden_size, ordered)
    order = "masked_embedding.token_ordering"
    load_weights(drafter, weight_files_of(folder), integers=frozenset({order} if ordered else ()))
    if drafter.masked_embedding is not None:
        found = drafter.masked_embedding.token_ordering
        if not torch.equal(found.sort().values, torch.arange(args.vocab_size)):
            raise ModelError(f"{folder}: {order} is not an ordering of the {args.vocab_size} tokens: the checkpoint "
                             "is damaged. Re-download it.")
    drafter.init_buffers()
    drafter.bind(target)
    return drafter.eval()
