"""export.weights=external: the weights in model.ptd beside model.pte, loaded together, checked before loading.

The program is the same bytes for any weights of its shapes (another data file can be swapped in), a program
without its data file is refused with both files named (ExecuTorch 1.5.1 itself crashes in load_method), and
bundles carry and verify both.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from exporters.errors import UserError
from exporters.export import check_config, checked_config
from exporters.manifest import MANIFEST_FILE
from exporters.program.weights import DataFileError, data_files_beside
from exporters.release.bundle import make_bundle, verify_bundle
from exporters.runtime.driver import Driver
from exporters.runtime.generator import Generator, SamplingConfig
from exporters.runtime.programs import LoadedProgram
from tests.helpers import compose_config

EXTERNAL = "export.weights=external"
# The tiny architecture with seeded random weights: two checkpoints of the same shapes. Decode only: which weights
# a program reads is the point, not its methods (logits() below runs a prompt through decode_one_token then).
SEEDED = ("model.random_init=true", "validate=false", EXTERNAL, "export.methods=[decode]", "export.layout=split")


def logits(pte: Path, data: Path | None = None) -> torch.Tensor:
    """Prompt logits of a program (with the given data file), through its prompt method."""
    program = LoadedProgram(pte, data_paths=[data] if data else None)
    driver = Driver.of(program)
    first = driver.prefill(torch.arange(1, 9).view(1, -1), 0)
    return torch.cat([first, driver.decode_one_token(int(first.argmax()), 8)]).clone()


def test_a_backend_that_cannot_write_a_data_file_is_refused_before_any_work() -> None:
    with pytest.raises(UserError, match=r"export.weights=external: backend=coreml .* supports export.weights=program"):
        check_config(checked_config(compose_config("backend=coreml", EXTERNAL, "export.layout=split")))


def test_the_pair_is_written_validated_and_listed(exported) -> None:  # type: ignore[no-untyped-def]
    result, single = exported(EXTERNAL), exported()
    m, pte = result.manifest, result.pte_path
    data = pte.with_suffix(".ptd")
    assert m.ok and m.validation is not None and m.validation.passed and m.validation.checked == "runtime"
    assert m.data is not None and m.data.file == "model.ptd" and m.data.size_bytes == data.stat().st_size
    assert m.data.entries > 10 and len(m.data.sha256) == 64
    # The program holds graphs only: no named data, no constants; the weights are the data file's.
    assert m.program.storage["named_data_bytes"] == 0 and m.program.storage["constant_buffer_bytes"] < 64
    assert m.program.size_bytes + m.data.size_bytes >= 0.9 * single.manifest.program.size_bytes
    assert m.program.size_bytes < single.manifest.program.size_bytes / 5
    assert "model.ptd" in m.runtime.load and "weight_cache_enabled" in m.runtime.packed_once
    # The same logits as the single-file program of the same export settings.
    assert torch.equal(logits(pte), logits(single.pte_path))
    assert not list(pte.parent.glob("*.unvalidated.*")), "no provisional file is left behind"


def test_a_program_without_its_data_file_is_refused_naming_both(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    result = exported(EXTERNAL)
    run = tmp_path / "run"
    shutil.copytree(result.pte_path.parent, run, ignore=shutil.ignore_patterns("checkpoint", "release"))
    (run / "model.ptd").unlink()
    for load in (lambda: LoadedProgram(run / "model.pte"), lambda: Generator(run)):
        with pytest.raises(DataFileError, match=r"model.pte keeps its weights in model.ptd, which is missing from"):
            load()
    with pytest.raises(DataFileError, match="model.ptd, which is missing"):
        make_bundle(run, tmp_path / "bundle")
    # Without a manifest the program's own table says it reads external weights.
    (run / MANIFEST_FILE).unlink()
    with pytest.raises(DataFileError, match=r"exported with export.weights=external\), and model.ptd is not beside it"):
        LoadedProgram(run / "model.pte")


def test_a_data_file_from_another_export_is_refused(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ours, other = exported(EXTERNAL), exported(*SEEDED, "quant=fp32", "model.seed=1")
    run = tmp_path / "run"
    shutil.copytree(ours.pte_path.parent, run, ignore=shutil.ignore_patterns("checkpoint", "release"))
    shutil.copy(other.pte_path.with_suffix(".ptd"), run / "model.ptd")
    with pytest.raises(DataFileError, match=r"model.ptd is not the data file exported with model.pte: its sha256"):
        Generator(run)
    with pytest.raises(DataFileError, match="another export"):
        data_files_beside(run / "model.pte")


@pytest.mark.parametrize("quant", ["fp32", "8da4w_emb4w"])
def test_the_program_is_the_same_bytes_for_other_weights_and_the_data_file_swaps(exported, quant: str) -> None:  # type: ignore[no-untyped-def]
    one, two = (exported(*SEEDED, f"quant={quant}", f"model.seed={seed}") for seed in (1, 2))
    assert one.pte_path.read_bytes() == two.pte_path.read_bytes()
    assert one.manifest.data.sha256 != two.manifest.data.sha256
    # Program one with data file two computes what program two computes: the weights are the data file's.
    swapped = logits(one.pte_path, two.pte_path.with_suffix(".ptd"))
    assert torch.equal(swapped, logits(two.pte_path))
    assert not torch.allclose(swapped, logits(one.pte_path))


def test_portable_programs_keep_their_weights_outside_too(exported) -> None:  # type: ignore[no-untyped-def]
    result = exported("backend=portable", EXTERNAL)
    m = result.manifest
    assert m.ok and m.validation.passed and m.data is not None
    assert m.program.storage["constant_buffer_bytes"] < 64 and "Nothing" in m.runtime.packed_once
    text = Generator(result.pte_path).generate("hello", SamplingConfig(max_new_tokens=4))
    assert len(text.new_ids) == 4


def test_bundles_carry_and_verify_both_files(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder, archive = make_bundle(exported(EXTERNAL).pte_path.parent, tmp_path / "b")
    assert {"model.pte", "model.ptd"} <= {p.name for p in folder.iterdir()}
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert set(manifest["files"]) >= {"model.pte", "model.ptd"} and manifest["data"]["file"] == "model.ptd"
    readme = (folder / "README.md").read_text()
    assert 'load_program("model.pte", data_path="model.ptd")' in readme and "--data_paths=model.ptd" in readme
    assert "weight_cache_enabled=true" in readme
    assert verify_bundle(folder) == [] and verify_bundle(archive) == []
    with open(folder / "model.ptd", "r+b") as fh:
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    assert [p for p in verify_bundle(folder) if p.startswith("changed: model.ptd")]


def test_sweep_rows_count_what_an_app_ships(exported) -> None:  # type: ignore[no-untyped-def]
    from exporters.sweeps.summary import JobRow

    m = exported(EXTERNAL).manifest
    row = JobRow(job=0, overrides=EXTERNAL, model="tiny", quant="fp32", backend="xnnpack", status="ok")
    row = row.with_manifest(m, "model.pte")
    assert row.size_mb == pytest.approx((m.program.size_bytes + m.data.size_bytes) / 1e6)
    assert row.data_mb == pytest.approx(m.data.size_bytes / 1e6)


def test_the_bench_measures_the_pair_with_and_without_the_weight_cache(exported, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from exporters.components.resolve import plan_export
    from exporters.stages.bench import BenchStage

    result = exported(EXTERNAL)
    run = tmp_path / "run"
    shutil.copytree(result.pte_path.parent, run, ignore=shutil.ignore_patterns("checkpoint", "release"))
    moved = dataclasses.replace(result, pte_path=run / "model.pte", manifest_path=run / MANIFEST_FILE)
    plan = plan_export(compose_config("bench=true", "benchmark.prompt_tokens=8", "benchmark.steps=4", "benchmark.repeats=1"))
    benched = BenchStage(plan).run(moved, None)  # type: ignore[arg-type]
    bench = benched.manifest.bench
    assert bench is not None and bench.decode_tokens_per_s > 0
    assert bench.rss_after_load_mb > 0 and bench.rss_after_load_without_weight_cache_mb > 0
    assert bench.pss_after_load_mb is not None and 0 < bench.pss_after_load_mb <= bench.rss_after_load_mb + 1
    assert "without XNNPACK's weight cache" in bench.describe() and "PSS" in bench.describe()
