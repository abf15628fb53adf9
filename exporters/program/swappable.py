"""``export.adapters=swappable``: the base's methods with LoRA slots, an adapter being data an app sets at run time.

The plan decides the slots once (:class:`SlotPlan`: which kinds of linear layer, the largest rank) from
``export.lora_targets`` / ``export.lora_max_rank`` or from the adapters given, reading only their files' headers;
load sizes them on the model (``models.lora_slots``); capture adds the method ``set_adapter``; validation sets each
adapter given and compares the base's methods with PEFT's model of it; finalize writes each as ``adapters/<name>.ptd``,
its tensors named as ``set_adapter``'s inputs (:data:`ADAPTER_FOLDER`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporters.config import AdapterMode, RotationKind
from exporters.errors import UserError
from models.lora import KEY, WEIGHTS_FILE

if TYPE_CHECKING:
    from exporters.config import ExportConfig, QuantConfig
    from models.lora_slots import SlotGeometry

# quant.adapters with swappable slots: the adapters' matrices set (and shipped) as int8 with a scale per row.
EIGHT_BIT_SLOTS = "8w"
ADAPTER_FOLDER = "adapters"  # beside the program: adapters/<name>.ptd
# Constant methods an app reads to fill set_adapter without the manifest.
LORA_INPUTS_CONSTANT = "get_lora_inputs"  # set_adapter's inputs, comma-separated: q_proj.A,q_proj.B,...
LORA_RANK_CONSTANT = "get_lora_max_rank"
# How an app swaps adapters (the manifest's swappable.how, the bundle's README).
SWAP_HOWTO = (
    "The program starts with every slot zero: the base model. To apply an adapter, call the method set_adapter once "
    f"with its tensors, in the order the constant method {LORA_INPUTS_CONSTANT} lists them (comma-separated), as "
    f"{ADAPTER_FOLDER}/<name>.ptd names them; every method computes with it from the next call on, until the next "
    "set_adapter (all zeros: the base again). Start a new conversation (position 0) after a swap: the KV cache holds "
    "the earlier tokens as the earlier adapter computed them. C++: load the file with "
    "executorch::extension::FlatTensorDataMap::load(FileDataLoader), get_data(name) for each input, wrap each as a "
    "tensor of the shape the manifest gives (extension/tensor from_blob), module.execute(\"set_adapter\", inputs). "
    "Python: python -m exporters.generate <run> adapter=<name, .ptd or PEFT folder>, or exporters.runtime.generator."
    "Generator(run, adapter=...); any PEFT folder whose targets and ranks fit becomes such a file with "
    "python -m exporters.adapter <run> <peft folder> out=<file.ptd>.")


@dataclass(frozen=True)
class SlotPlan:
    """The slots of a swappable program: the kinds of linear layer with one in every decoder layer, and the rank."""

    targets: tuple[str, ...]
    rank: int
    eight_bit: bool = False  # set_adapter takes the matrices in 8 bits (quant.adapters=8w), else in the slots' dtype

    def describe(self) -> str:
        stored = ", set from 8-bit matrices" if self.eight_bit else ""
        return f"LoRA slots of rank {self.rank} on {', '.join(self.targets)}{stored}"


def _adapter_shapes(folder: str) -> dict[str, int]:
    """Kind of layer -> the largest rank an adapter folder gives it, from its safetensors header alone."""
    from safetensors import safe_open


    ranks: dict[str, int] = {}
    with safe_open(str(Path(folder).expanduser() / WEIGHTS_FILE), framework="pt") as fh:
        for key in fh.keys():
            match = KEY.match(key)
            if match is not None and match["part"] == "A":  # A is [rank, in]
                kind = match["module"].rsplit(".", 1)[-1]
                ranks[kind] = max(fh.get_slice(key).get_shape()[0], ranks.get(kind, 0))
    return ranks


def slot_plan(cfg: ExportConfig) -> SlotPlan | None:
    """The slots ``cfg`` asks for (None unless ``export.adapters=swappable``), every adapter given checked to fit."""
    ex = cfg.export
    if ex.adapters != AdapterMode.swappable:
        for key in ("lora_max_rank", "lora_targets"):
            if getattr(ex, key) is not None:
                raise UserError(f"export.{key}={getattr(ex, key)} sizes the LoRA slots of export.adapters=swappable, "
                                f"and export.adapters={ex.adapters}. Set export.adapters=swappable, or leave "
                                f"export.{key} unset.")
        return None
    given = {name: _adapter_shapes(folder) for name, folder in cfg.model.adapters.items()}
    if not given and (ex.lora_max_rank is None or not ex.lora_targets):
        raise UserError("export.adapters=swappable without model.adapters: give the slots' size, e.g. "
                        "export.lora_max_rank=16 'export.lora_targets=[q_proj,v_proj]' (the largest rank and the "
                        "kinds of linear layer an adapter may change), or give the adapters to size them by.")
    needed = sorted({kind for ranks in given.values() for kind in ranks})
    targets = tuple(ex.lora_targets) if ex.lora_targets else tuple(needed)
    rank = ex.lora_max_rank if ex.lora_max_rank is not None else max(r for g in given.values() for r in g.values())
    if rank < 1:
        raise UserError(f"export.lora_max_rank={rank}: give the largest rank an adapter may have (1 or more).")
    for name, ranks in given.items():
        outside = sorted(set(ranks) - set(targets))
        if outside:
            raise UserError(f"model.adapters.{name} changes {', '.join(outside)}, and export.lora_targets is "
                            f"[{', '.join(targets)}]. Add {', '.join(outside)} to export.lora_targets, or leave it "
                            "unset to take the adapters' targets.")
        too_big = {kind: r for kind, r in ranks.items() if r > rank}
        if too_big:
            raise UserError(f"model.adapters.{name} has rank {max(too_big.values())} (on "
                            f"{', '.join(sorted(too_big))}), above export.lora_max_rank={rank}. Raise "
                            "export.lora_max_rank, or leave it unset to take the adapters' largest rank.")
    return SlotPlan(targets, rank, eight_bit=cfg.quant.adapters == EIGHT_BIT_SLOTS)


def base_quant(cfg: ExportConfig) -> QuantConfig:
    """The quant config of the model's own layers. With swappable slots ``quant.adapters`` is how ``set_adapter``
    takes the adapters' matrices (:data:`EIGHT_BIT_SLOTS`), not a scheme for PEFT's layers: they stay as trained, the
    eager reference, and no backend kernel runs them."""
    if cfg.export.adapters != AdapterMode.swappable:
        return cfg.quant
    return replace(cfg.quant, adapters=None)


def check_swappable(cfg: ExportConfig, swapping: tuple[str, ...]) -> None:
    """What swappable slots cannot be combined with yet, refused by name before any work. ``swapping``: the backends
    whose programs swap adapters here (``Backend.swaps_adapters``)."""
    if cfg.export.adapters != AdapterMode.swappable:
        return
    blockers = []
    if cfg.backend.name not in swapping:
        blockers.append((f"backend={cfg.backend.name}", "a swapped adapter is validated in this machine's runtime",
                         f"use backend={' or backend='.join(swapping)}"))
    if cfg.quant.rotation != RotationKind.none or cfg.quant.online_hadamard:
        blockers.append(("quant.rotation / quant.online_hadamard", "a rotated base would need each adapter's A "
                         "rotated as it is set", "use quant=8da4w_calibrated (GPTQ) or quant=8da4w"))
    if cfg.quant.pt2e is not None:
        blockers.append((f"quant.pt2e={cfg.quant.pt2e}", "the backend's quantizer converts a graph without the slots",
                         "use a torchao scheme (quant=8da4w, 8da8w, 8da4w_calibrated)"))
    if cfg.quant.adapters not in (None, EIGHT_BIT_SLOTS):
        blockers.append((f"quant.adapters={cfg.quant.adapters}", "the slots compute in the activations' dtype, set "
                         f"from the adapters' matrices as they are or in 8 bits with a scale per row "
                         f"(quant.adapters={EIGHT_BIT_SLOTS})", f"use quant.adapters={EIGHT_BIT_SLOTS} or leave it "
                         "unset (or use export.adapters=methods)"))
    if cfg.draft.checkpoint is not None:
        blockers.append(("draft.checkpoint", "speculative programs do not hold adapters yet",
                         "export without draft.*"))
    if blockers:
        lines = "; ".join(f"{option}: {why}. Instead, {fix}" for option, why, fix in blockers)
        raise UserError(f"export.adapters=swappable cannot be combined with {lines}.")


def slot_constants(geometry: SlotGeometry) -> dict[str, Any]:
    """The constant methods that tell an app how to fill set_adapter (the manifest says more)."""
    return {LORA_INPUTS_CONSTANT: ",".join(geometry.input_names()), LORA_RANK_CONSTANT: geometry.rank}


def adapter_file(run: Path, name: str) -> Path:
    """Where the export writes adapter ``name`` given at export time."""
    return run / ADAPTER_FOLDER / f"{name}.ptd"


def products_after_projections() -> Any:
    """A pass (after ``to_edge``, before partitioning) moving each slot's product (its two ``bmm`` and the ``add``
    onto the layer's output) down to just before the first op that uses it.

    Why: XNNPACK's partitioner keeps the dynamically quantized projections that share one input (q, k and v; gate and
    up) in one group, and merges partitions greedily from the graph's end. Traced in call order, q's product sits
    between q's and v's projections; when the group is met, q's ``add`` is still outside the growing partition and
    leads back into it, so the group cannot join and each layer with slots is cut into three delegate calls
    (measured: 91 instead of 31 on SmolLM2-135M 8da4w with slots on every linear). After this pass every product
    comes after its group, and a layer is one partition again. The order of independent ops changes, no value."""
    from executorch.exir.dialects._ops import ops as exir_ops
    from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult

    bmm, add, index_put = (exir_ops.edge.aten.bmm.default, exir_ops.edge.aten.add.Tensor,
                           exir_ops.edge.aten.index_put.default)

    class ProductsAfterProjections(ExportedProgramPassBase):
        def call(self, exported_program: Any) -> ExportedProgramPassResult:
            slot_inputs = {name for name, buffer in exported_program.graph_signature.inputs_to_buffers.items()
                           if buffer.startswith("lora_slots.")}

            def is_slot(node: Any) -> bool:  # the buffer, or the in-place write that keeps it state
                return node.name in slot_inputs or (node.target == index_put and is_slot(node.args[0]))

            graph = exported_program.graph
            product = set()
            for node in graph.nodes:
                if node.target == bmm and (is_slot(node.args[1]) or node.args[0] in product):
                    product.add(node)
                elif node.target == add and any(a in product and a.target == bmm for a in node.args):
                    product.add(node)
            order = {node: i for i, node in enumerate(graph.nodes)}
            for node in reversed([n for n in graph.nodes if n in product]):
                first_user = min(node.users, key=lambda u: order[u])
                first_user.prepend(node)  # its users after it moved already: the graph stays in order
                order[node] = order[first_user] - 0.5
            graph.lint()
            exported_program.graph_module.recompile()
            return ExportedProgramPassResult(exported_program, bool(product))

    return ProductsAfterProjections()
