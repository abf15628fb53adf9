"""The quality warning (``validation.warn_ppl_increase``): which remedies apply, what they are measured to win
back, and that the warning reaches the manifest and the console."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from exporters.config import quant_option, to_typed
from exporters.errors import UserError
from exporters.export import checked_config, run_stages
from exporters.manifest import Manifest
from exporters.quant.advice import changes, stored_bytes
from exporters.quant.apply import quantize_model
from tests.helpers import compose_config

# 8da4w over a threshold of 0 (the tiny model loses only a little), decode only: advise measures the eager model, so
# the program's methods do not matter.
COSTLY = ("quant=8da4w", "validation.warn_ppl_increase=0", "export.methods=[decode]", "export.layout=split")


@pytest.mark.parametrize("quant,overrides", [
    ("8da4w", ["quant.lm_head=8da8w quant.lm_head_group_size=0", "quant.algorithm=gptq"]),
    ("8da4w_emb4w", ["quant.lm_head=8da8w quant.lm_head_group_size=0", "quant.embedding=8w",
                     "quant.algorithm=gptq"]),
    ("8da4w_g128", ["quant.lm_head=8da8w quant.lm_head_group_size=0", "quant.algorithm=gptq",
                    "quant.group_size=32 quant.lm_head_group_size=32"]),
    ("8da4w_calibrated", ["quant.lm_head=8da8w quant.lm_head_group_size=0",
                          "quant.rotation=hadamard quant.online_hadamard=true"]),
    ("8da8w", ["quant.algorithm=gptq"]),
    ("fp16", []),
    ("pt2e_xnnpack_static", []),
])
def test_the_remedies_that_apply_to_each_scheme(quant: str, overrides: list[str]) -> None:
    assert [c.overrides for c in changes(to_typed(compose_config(f"quant={quant}")).quant)] == overrides


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(UserError, match="validation.warn_ppl_increase=-0.1"):
        checked_config(compose_config("validation.warn_ppl_increase=-0.1"))


def test_stored_bytes_counts_integer_codes_at_their_width(tmp_path: Path) -> None:
    loaded, _ = run_stages(compose_config("validate=false"), tmp_path, stop_after="load")
    model = loaded.model
    fp32 = stored_bytes(model)
    assert fp32 == 4 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    weights = sum(m.weight.numel() for m in linears.values())
    cfg = dataclasses.replace(quant_option("8da8w"), lm_head=None)
    quantize_model(model, cfg)
    scales = sum(m.weight.shape[0] for m in linears.values())
    assert stored_bytes(model) == fp32 - 4 * weights + weights + 4 * scales


def test_a_costly_scheme_warns_in_the_manifest_and_the_console_with_measured_remedies(exported, caplog) -> None:
    """Over the threshold (0 here: the tiny model loses only a little), each remedy is measured on the eager
    model: its perplexity on the validation text, the share of the loss it wins back, the bytes it adds."""
    result = exported(*COSTLY)
    m = Manifest.read(result.manifest_path)
    warning, v = m.quality_warning, m.validation
    assert warning is not None and warning.threshold == 0
    assert warning.ppl_increase == pytest.approx(v.perplexity / v.baseline_perplexity - 1, abs=1e-4)
    assert {r.change for r in warning.remedies} == {c.overrides for c in changes(quant_option("8da4w"))}
    loss = v.eager_perplexity - v.baseline_perplexity
    for r in warning.remedies:
        assert r.recovered == pytest.approx((v.eager_perplexity - r.perplexity) / loss, abs=0.01)  # rounded
    gptq = next(r for r in warning.remedies if r.change == "quant.algorithm=gptq")
    head = next(r for r in warning.remedies if "lm_head" in r.change)
    assert gptq.extra_mb == 0 and head.extra_mb > 0  # same format / 8-bit rows in place of 4-bit groups
    assert m.status == "ok"  # a warning, not a rejection
    from exporters.console import log_export_summary
    with caplog.at_level("INFO", logger="exporters"):
        log_export_summary(result)
    assert any(r.levelname == "WARNING" and "quant.algorithm=gptq" in r.getMessage() for r in caplog.records)


def test_no_warning_under_the_threshold(exported) -> None:
    # The 8da4w program tests/test_draft.py and tests/test_speculative.py read (its verify method changes nothing here).
    m = exported("quant=8da4w", "export.methods=[prefill,decode,forward,verify]").manifest
    assert m.quality_warning is None and m.validation.perplexity / m.validation.baseline_perplexity - 1 < 0.2


def test_remedies_that_would_not_fit_are_named_not_measured(exported, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under a memory limit the export fits but a remedy holding the model whole (GPTQ) would not, that remedy is
    skipped and named with why in the warning, rather than risk the out-of-memory killer ending the export after its
    program was written; the others are measured as usual. (An earlier measurement would be read back, as it costs
    no memory: a fresh cache folder here.)"""
    monkeypatch.setenv("LLM_EXPORTERS_CACHE", str(tmp_path / "cache"))
    from exporters.plan.footprint import GB
    from exporters.stages.load import planned_footprint
    from exporters.components.resolve import plan_export

    footprint = planned_footprint(plan_export(compose_config(*COSTLY)), tmp_path)
    assert footprint.advise is not None and footprint.advise > footprint.peak
    limit = round((footprint.peak + footprint.advise) / 2 / GB, 4)  # the export fits, advise's whole model does not
    warning = exported(*COSTLY, f"export.memory_limit_gb={limit}").manifest.quality_warning
    assert warning is not None
    whole = {c.overrides for c in changes(quant_option("8da4w")) if c.casts_whole}
    assert whole == {"quant.algorithm=gptq"}
    assert set(warning.unmeasured) == whole and "would need about" in warning.unmeasured["quant.algorithm=gptq"]
    assert {r.change for r in warning.remedies} == {c.overrides for c in changes(quant_option("8da4w"))} - whole
    assert "not measured: quant.algorithm=gptq" in warning.describe()


def test_a_remedy_measured_once_is_read_back_for_the_same_model_text_and_config(tmp_path: Path, caplog) -> None:
    """advise keeps each measurement (exporters.quant.remedy_cache): the next export of the same model, validation
    text and quant config reads it back instead of building, quantizing and scoring a fresh model, and gives the same
    warning; other validation windows are another measurement. Before measuring, the console says how many remedies
    and about how long, and how to turn them off."""
    from exporters.components.language_model import read_calibration
    from exporters.config import KvDType
    from exporters.program.versions import package_versions
    from exporters.quant.advice import Loss, StageSeconds, Trials, advise
    from exporters.quant.remedy_cache import RemedyCache, identity
    from exporters.runtime.quality import full_sequence, perplexity, window_logits

    quantized, ctx = run_stages(compose_config(*COSTLY), tmp_path / "run", stop_after="quantize")
    decoder, text = ctx.plan.main, ctx.baseline.text
    builds = []

    def build():  # type: ignore[no-untyped-def]
        builds.append(1)
        return decoder.build.build(ctx.checkpoint)

    def score(model) -> float:  # type: ignore[no-untyped-def]
        with model.kv_dtype_as(KvDType.fp32):
            return perplexity(text.nll(window_logits(full_sequence(model), text)), text.scored_tokens)

    def warning(prompt_tokens: int):  # type: ignore[no-untyped-def]
        cache = RemedyCache(tmp_path / "advice", identity(ctx.plan.resolved_config["model"], ctx.checkpoint.weight_stats,
                                                          text.windows, prompt_tokens, package_versions()))
        trials = Trials(build, score, lambda m: lambda: read_calibration(decoder.quant.config.calibration,
                                                                         decoder.build.source, m, ctx.checkpoint),
                        StageSeconds(1.0, 2.0, 3.0), cache)
        loss = Loss(0.0, 0.5, score(quantized.model), ctx.baseline.perplexity)
        return advise(decoder.quant, loss, quantized.model, trials)

    remedies = len(changes(decoder.quant.config))
    with caplog.at_level("INFO", logger="exporters"):
        first = warning(text.prompt_tokens)
    assert len(builds) == remedies
    assert any(f"{remedies} remedies to measure, about " in r.getMessage() and "validation.warn_ppl_increase=null"
               in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("INFO", logger="exporters"):
        again = warning(text.prompt_tokens)
    assert len(builds) == remedies and again.remedies == first.remedies  # nothing built: read back
    assert any(f"0 remedies to measure, about 0 s (estimated), {remedies} read from an earlier measurement" in
               r.getMessage() for r in caplog.records)
    warning(text.prompt_tokens + 1)  # other windows: measured again
    assert len(builds) == 2 * remedies
