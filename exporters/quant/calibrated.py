"""Calibrated quantization: the linear layers quantized one decoder layer at a time, each with GPTQ on the
inputs it sees when every earlier layer is already quantized.

Running the whole text through one layer at a time (the hidden states of every window kept between layers)
costs one forward pass in all, and each layer is calibrated on the inputs the quantized program will give it,
so the error of the layers before it is compensated too, not only its own. Linears that read the same tensor
(q/k/v, gate/up) share one input statistic and are solved together (GPTQ treats rows independently).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from exporters.quant.calibration import CalibrationText, LayerByLayer
from exporters.quant.gptq import gptq
from exporters.quant.schemes import IntScheme
from models.decoder import CausalLM
from models.mapped_pages import release_file_pages

log = logging.getLogger("exporters")


@dataclass
class SharedInput:
    """``sum x x^T`` over every calibration token of one input tensor, and the linears that read it."""

    names: list[str] = field(default_factory=list)
    hessian: torch.Tensor | None = None
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        outer = x.T @ x
        self.hessian = outer if self.hessian is None else self.hessian + outer
        self.tokens += x.shape[0]


@dataclass(frozen=True)
class Target:
    """One linear to quantize: its module, its integer format and group size."""

    module: nn.Linear
    scheme: IntScheme
    group_size: int


class InputRecorder:
    """Forward pre-hooks on the targets of one decoder layer: which of them read the same tensor, and the
    statistics of each distinct input."""

    def __init__(self, targets: dict[str, Target]) -> None:
        self.inputs: list[SharedInput] = []
        self._seen: list[tuple[torch.Tensor, SharedInput]] = []  # the first call's inputs, held so ids stay unique
        self._first_call = True
        self._by_name: dict[str, SharedInput] = {}
        self._handles = [t.module.register_forward_pre_hook(self._hook(name)) for name, t in targets.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            if self._first_call:
                shared = next((s for t, s in self._seen if t is x), None)
                if shared is None:
                    shared = SharedInput()
                    self.inputs.append(shared)
                    self._seen.append((x, shared))
                    shared.add(x)
                shared.names.append(name)
                self._by_name[name] = shared
            else:
                shared = self._by_name[name]
                if shared.names[0] == name:  # each input counted once, at its first reader
                    shared.add(x)
        return record

    def next_call(self) -> None:
        """The first call's inputs said which targets share one; later calls (chunks, windows) only add to them."""
        self._first_call = False
        self._seen.clear()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def solve(names: list[str], targets: dict[str, Target], shared: SharedInput) -> None:
    """GPTQ for linears that read one input; those of one format are stacked and solved at once."""
    assert shared.hessian is not None
    by_format: dict[tuple[IntScheme, int], list[str]] = {}
    for name in names:
        by_format.setdefault((targets[name].scheme, targets[name].group_size), []).append(name)
    for (scheme, group), members in by_format.items():
        weights = [targets[n].module.weight for n in members]
        codes, scales = gptq(torch.cat([w.detach() for w in weights]), shared.hessian, shared.tokens,
                             scheme.grid(group))
        row = 0
        for name, w in zip(members, weights):
            rows = w.shape[0]
            module = targets[name].module
            module.weight = nn.Parameter(scheme.weight(codes[row:row + rows], scales[row:row + rows], group, w.dtype),
                                         requires_grad=False)
            row += rows
        release_file_pages(weights)  # the checkpoint's pages of the weights just replaced


def calibrate_layer(run: LayerByLayer, i: int, states: list[torch.Tensor], here: dict[str, Target],
                    step: Callable[[], None]) -> None:
    """GPTQ for ``here``, the targets of decoder layer ``i``, on the inputs ``states`` give them."""
    recorder = InputRecorder(here)
    try:
        run.layer(i, states, after_each=recorder.next_call)
    finally:
        recorder.close()
    for shared in recorder.inputs:
        solve(shared.names, here, shared)
        for _ in shared.names:
            step()


def finish_with_head(model: CausalLM, targets: dict[str, Target], states: list[torch.Tensor], solved: set[str],
                     step: Callable[[], None]) -> None:
    """After the decoder layers (``states``: the last one's outputs, quantized): GPTQ for ``lm_head`` on the final
    norm's outputs, then the check that every target was quantized."""
    model.reset_cache()
    if "lm_head" in targets:
        head = SharedInput(names=["lm_head"])
        for h in states:
            head.add(model.final_norm(h))
        solve(head.names, targets, head)
        solved.add("lm_head")
        step()
    missed = sorted(set(targets) - solved)
    assert not missed, f"calibration never ran these linears, so they were not quantized: {missed}"


@torch.no_grad()
def quantize_calibrated(model: CausalLM, targets: dict[str, Target], text: CalibrationText,
                        step: Callable[[], None]) -> None:
    """Quantize ``targets`` (module path -> what it becomes) with GPTQ on ``text``, one decoder layer at a time,
    then ``lm_head`` on the final norm's outputs; ``step`` is called once per quantized linear."""
    run = LayerByLayer(model, text.windows)
    states = run.embedded
    solved: set[str] = set()
    for i in range(len(model.model.layers)):
        here = {n: t for n, t in targets.items() if n.startswith(f"model.layers.{i}.")}
        if here:
            calibrate_layer(run, i, states, here, step)
            solved.update(here)
        states = run.layer(i, states)  # what the next layer sees: this one's output, quantized
    finish_with_head(model, targets, states, solved, step)
