"""Faults a user meets (issue 46): folders that cannot be written, Ctrl-C and SIGTERM in every stage and in a sweep,
a full disk, two exports in one folder, and inputs damaged under the export. Each ends in one paragraph (or one line)
and leaves no file that looks finished."""

from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from exporters.errors import Interrupted, UserError
from exporters.export import run_stages
from exporters.output.interrupts import held_back, sigterm_interrupts
from exporters.manifest import Manifest
from exporters.output.folder import LOCK_FILE, check_writable, held
from models.errors import ModelError
from tests.helpers import REPO_ROOT, compose_config, copy_checkpoint

# The cheapest export with every stage: decode only, quantized, validated, benchmarked for a few steps.
EVERY_STAGE = ("quant=8da4w", "export.methods=[decode]", "export.layout=split", "bench=true", "benchmark.steps=4",
               "benchmark.prompt_tokens=4", "benchmark.repeats=1", "validation.max_tokens=64",
               "validation.warn_ppl_increase=0")
DECODE_ONLY = ("export.methods=[decode]", "export.layout=split", "validation.max_tokens=64")
# A folder nobody can write, root included: sysfs is read-only.
READ_ONLY = Path("/sys/kernel")


def leftovers(folder: Path) -> list[str]:
    """Program, data, provisional, staged and temporary files in ``folder``."""
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".pte", ".ptd") or re.search(r"\.(tmp|staged)$", p.name)
                  or p.name == LOCK_FILE) if folder.is_dir() else []


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          **kwargs)


def one_paragraph(proc: subprocess.CompletedProcess[str], *says: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out and "HYDRA_FULL_ERROR" not in out, out
    for text in says:
        assert text in out, out
    return out


# ---- 1. output folders --------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["inside", "itself"])
def test_a_run_folder_that_cannot_be_written_is_one_paragraph(where: str) -> None:
    """A run folder inside a read-only directory (Hydra's mkdir would raise PermissionError) or a read-only folder
    itself (Hydra's log file would fail to open): refused before Hydra touches it, naming the folder and the fix."""
    folder = READ_ONLY / "llm-run" if where == "inside" else READ_ONLY
    proc = cli("exporters.llm", f"hydra.run.dir={folder}")
    one_paragraph(proc, f"the run folder (hydra.run.dir) {folder} cannot be", "hydra.run.dir=<dir>")


def test_an_output_folder_behind_a_file_is_one_paragraph(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("in the way")
    proc = cli("exporters.llm", f"hydra.run.dir={tmp_path / 'run'}", f"export.output_dir={tmp_path / 'file' / 'out'}")
    one_paragraph(proc, f"{tmp_path / 'file'} is a file, not a folder", "export.output_dir=<dir>")
    assert not leftovers(tmp_path / "run")


def test_a_sweep_folder_that_cannot_be_written_is_one_paragraph() -> None:
    proc = cli("exporters.llm", "-m", "quant=fp32,8da4w", f"hydra.sweep.dir={READ_ONLY / 'sweep'}")
    one_paragraph(proc, f"the sweep folder (hydra.sweep.dir) {READ_ONLY / 'sweep'} cannot be created",
                  "hydra.sweep.dir=<dir>")


def test_the_library_checks_its_output_folder_too(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"the output folder /sys/kernel cannot be written .*export.output_dir=<dir>"):
        run_stages(compose_config(), READ_ONLY)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is a file, not a folder"):
        check_writable(tmp_path / "file" / "x", "the folder", "fix it.")


# ---- 2. interruption ----------------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def default_signals() -> None:
    """Each test here starts from the signal handling a fresh process has (Ctrl-C raises, SIGTERM ends it, neither
    blocked), whatever an earlier test in the same worker left: in a full run on 2026-11-28 five of these tests found
    SIGINT swallowed in one worker (it did not reach the export, nor a child started from it). What was found is
    reported as a warning, to name the test that leaves it."""
    import warnings

    found = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM),
             signal.pthread_sigmask(signal.SIG_BLOCK, []))
    if found != (signal.default_int_handler, signal.SIG_DFL, set()):
        warnings.warn(f"signal handling left by an earlier test: SIGINT {found[0]}, SIGTERM {found[1]}, blocked "
                      f"{sorted(found[2])}")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])


class SignalAt:
    """Observer sending this process a real signal as the named stage starts."""

    def __init__(self, stage: str, signum: signal.Signals) -> None:
        self.stage, self.signum = stage, signum

    def stage_started(self, name: str) -> None:
        if name == self.stage:
            os.kill(os.getpid(), self.signum)
            time.sleep(1)  # the handler runs at the next bytecode: well within this

    def stage_finished(self, name: str, seconds: float) -> None: ...


STAGES = ["load", "baseline", "quantize", "capture", "lower", "emit", "validate", "advise", "finalize", "bench"]
# The full run signals the first stage, the longest, the first after emit wrote the provisional program, the one that
# puts the export in place and the one after it; `pytest -m extended` every other stage too (each adds its
# predecessors' time, for the same cleanup path).
FULL_RUN_STAGES = {"load", "lower", "validate", "finalize", "bench"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(s, marks=[] if s in FULL_RUN_STAGES else [pytest.mark.extended])
                                   for s in STAGES])
def test_a_signal_in_any_stage_stops_it_and_leaves_nothing(stage: str, tmp_path: Path) -> None:
    """SIGINT and SIGTERM (alternately) as each stage starts: Interrupted names the stage and the signal, and no
    program, data or temporary file is left (after finalize, in bench, the finished program stays, and says so)."""
    signum = signal.SIGTERM if STAGES.index(stage) % 2 else signal.SIGINT
    plan_overrides = compose_config(*EVERY_STAGE)
    with sigterm_interrupts(), pytest.raises(Interrupted) as stopped:
        run_stages(plan_overrides, tmp_path, observer=SignalAt(stage, signum))
    e = stopped.value
    assert (e.stage, e.signal_name, e.exit_code) == (stage, signum.name, 128 + signum.value)
    if stage == "bench":
        assert e.kept and "already written and validated" in e.describe()
        manifest = Manifest.read(tmp_path)
        assert leftovers(tmp_path) == ["model.pte"] and manifest.ok and manifest.bench is None
    else:
        assert "Nothing was written" in e.describe() and leftovers(tmp_path) == []
        assert not (tmp_path / "manifest.json").exists()


def test_signals_wait_for_the_end_of_a_block_held_back() -> None:
    """Finalize renames the program, its data files and the manifest into place with signals held back."""
    done = []
    with sigterm_interrupts(), pytest.raises(KeyboardInterrupt) as stopped:
        with held_back():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
            done.append("renamed")
    assert done == ["renamed"] and stopped.value.signum == signal.SIGTERM  # type: ignore[attr-defined]


def run_until(args: list[str], line: str, signum: signal.Signals, cwd: Path = REPO_ROOT, group: bool = False
              ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m <args>`` and send it ``signum`` once its console shows a line matching ``line`` (to its whole
    process group with ``group``, as a terminal's Ctrl-C does)."""
    proc = subprocess.Popen([sys.executable, "-m", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    assert proc.stdout is not None
    seen = []
    for text in proc.stdout:
        seen.append(text)
        if re.search(line, text):
            (os.killpg if group else os.kill)(proc.pid, signum)
            break
    out, _ = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(seen) + out, "")


@pytest.mark.slow
# Ctrl-C's exit code comes from the same Interrupted as SIGTERM's (checked in process above for every stage).
@pytest.mark.parametrize("signum", [pytest.param(signal.SIGINT, marks=pytest.mark.extended), signal.SIGTERM],
                         ids=["ctrl-c", "sigterm"])
def test_the_cli_says_which_stage_a_signal_stopped_and_exits_128_plus_it(signum: signal.Signals, tmp_path: Path) -> None:
    proc = run_until(["exporters.llm", *DECODE_ONLY, f"hydra.run.dir={tmp_path}"], r"\] lower \.\.\.", signum)
    line = (f"export interrupted ({signum.name}) during the lower stage. Nothing was written: no program, data or "
            "temporary file is left, and a finished earlier export in this folder is as it was.")
    assert proc.returncode == 128 + signum.value and line in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout and leftovers(tmp_path) == []


@pytest.mark.slow
def test_an_interrupted_sweep_keeps_the_finished_jobs_and_records_the_interrupted_one(tmp_path: Path) -> None:
    """Ctrl-C to the sweep's process group while job 1 lowers: job 0's row stays, job 1's says where it stopped, the
    summary is written, and job 2 never starts."""
    sweep = tmp_path / "sweep"
    proc = run_until(["exporters.llm", "-m", "quant=fp32,8da4w,8da8w", *DECODE_ONLY, "bench=false",
                      f"hydra.sweep.dir={sweep}"],
                     r"\[job 1\] \[\d+/\d+\] lower \.\.\.", signal.SIGINT, group=True)
    assert proc.returncode == 130 and "Traceback" not in proc.stdout, proc.stdout
    assert "sweep interrupted during job 1: 1 job(s) finished before it are kept" in proc.stdout
    rows = (sweep / "summary.csv").read_text()
    assert "8da8w" not in rows and len(rows.strip().splitlines()) == 3  # the header, job 0 and job 1
    job1 = next(sweep.glob("1-*"))
    assert "interrupted (SIGINT) during the" in (job1 / "FAILED").read_text() and leftovers(job1) == []
    assert Manifest.read(next(sweep.glob("0-*"))).ok


# ---- 3. a full disk -----------------------------------------------------------------------------------------

def _file_size_limit(limit: int):  # type: ignore[no-untyped-def]
    def apply() -> None:  # in the child: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ ignored)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.slow
def test_a_data_file_over_the_file_size_limit_is_one_paragraph_and_leaves_nothing(tiny_checkpoint: Path,
                                                                                   tmp_path: Path) -> None:
    """The process may write no file larger than 64 kB: with external weights the program fits and its data file
    does not. One paragraph with the bytes needed, exit 2, nothing kept (the program written before it removed)."""
    limit = 64_000
    proc = cli("exporters.llm", "model=llama", f"model.checkpoint={tiny_checkpoint}", *DECODE_ONLY,
               "export.weights=external", f"hydra.run.dir={tmp_path}", preexec_fn=_file_size_limit(limit))
    out = one_paragraph(proc, f"model.pte and its data file could not be written completely into {tmp_path}",
                        "Nothing was kept", "file-size limit", "ulimit -f unlimited")
    needed = int(re.search(r"need [\d.,]+ MB \(([\d,]+) bytes\)", out).group(1).replace(",", ""))
    assert needed > limit and leftovers(tmp_path) == [] and not (tmp_path / "manifest.json").exists()


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A 256 kB file system (tmpfs) at ``tmp_path / "disk"``: the tiny program (about 0.5 MB) does not fit."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root with CAP_SYS_ADMIN")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_is_one_paragraph_with_the_bytes_needed_and_free(small_disk: Path, tiny_checkpoint: Path) -> None:
    run = small_disk / "run"
    proc = cli("exporters.llm", "model=llama", f"model.checkpoint={tiny_checkpoint}", *DECODE_ONLY,
               f"hydra.run.dir={run}")
    out = one_paragraph(proc, f"model.pte could not be written completely into {run}", "MB free (No space left on "
                        "device). Nothing was kept. Free some space, or export into a folder on another disk")
    needed = int(re.search(r"need [\d.,]+ MB \(([\d,]+) bytes\)", out).group(1).replace(",", ""))
    assert needed > shutil.disk_usage(small_disk).total and leftovers(run) == []


# ---- 4. two exports, one folder -----------------------------------------------------------------------------

def test_a_second_export_into_a_folder_being_written_is_refused(tmp_path: Path) -> None:
    with held(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == str(os.getpid())
        with pytest.raises(UserError, match=rf"another export \(process {os.getpid()}\) is writing into {tmp_path}"):
            run_stages(compose_config(*DECODE_ONLY), tmp_path)
    assert not (tmp_path / LOCK_FILE).exists() and not list(tmp_path.glob("*.pte"))


@pytest.mark.slow
def test_a_running_export_holds_its_folder_against_another_process(tmp_path: Path) -> None:
    """A real export in another process, caught while it lowers: this one is refused naming that process."""
    proc = subprocess.Popen([sys.executable, "-m", "exporters.llm", *DECODE_ONLY, f"hydra.run.dir={tmp_path}"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    for text in proc.stdout:
        if "lower ..." in text:
            break
    with pytest.raises(UserError, match=rf"another export \(process {proc.pid}\) is writing into"):
        run_stages(compose_config(*DECODE_ONLY), tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143 and leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_finished_export_is_replaced_whole(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """An export with its weights in model.ptd, then one with them in the program, into the same folder: the data
    file goes with the export it belonged to, and the manifest describes the program beside it."""
    run_stages(compose_config(*DECODE_ONLY, "export.weights=external"), tmp_path)
    assert (tmp_path / "model.ptd").is_file()
    run_stages(compose_config(*DECODE_ONLY), tmp_path)
    m = Manifest.read(tmp_path)
    assert leftovers(tmp_path) == ["model.pte"] and m.data is None
    from exporters.package import main as package

    assert package([str(tmp_path)]) == 0 and package(["--verify", str(next((tmp_path / "release").glob("*.tar.gz")))]) == 0
    assert package([str(tmp_path), f"out={READ_ONLY / 'bundles'}"]) == 2  # and its out= folder is checked
    assert f"the bundle folder {READ_ONLY / 'bundles'} cannot be created" in capsys.readouterr().err


# ---- 5. damaged inputs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_named_by_tensor_before_quantizing(value: float, tiny_checkpoint: Path,
                                                                  tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, :5] = value
    save_file(tensors, str(weights))
    with pytest.raises(ModelError, match=rf"NaN or infinite weights in 1 tensor\(s\): {re.escape(name)} \(5 of"):
        run_stages(compose_config("model=llama", f"model.checkpoint={ckpt}", "quant=8da4w"), tmp_path / "run",
                   stop_after="quantize")


@pytest.mark.slow
def test_weights_changed_while_the_export_reads_them_are_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The weight file rewritten while the export lowers (a copy still running, a download finishing): refused at
    finalize, before anything is put in place."""
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")

    class Rewrite:
        def stage_started(self, name: str) -> None:
            if name == "lower":
                tensors = load_file(str(ckpt / "model.safetensors"))
                save_file({k: v + 1 for k, v in tensors.items()}, str(ckpt / "model.safetensors"))

        def stage_finished(self, name: str, seconds: float) -> None: ...

    with pytest.raises(ModelError, match=r"model.safetensors changed while the export read it .* nothing was kept"):
        run_stages(compose_config("model=llama", f"model.checkpoint={ckpt}", *DECODE_ONLY), tmp_path / "run",
                   observer=Rewrite())
    assert leftovers(tmp_path / "run") == [] and not (tmp_path / "run" / "manifest.json").exists()


def test_a_truncated_safetensors_file_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match="damaged or truncated safetensors file"):
        run_stages(compose_config("model=llama", f"model.checkpoint={ckpt}"), tmp_path / "run", stop_after="load")


def test_a_gguf_tensor_pointing_past_the_file_is_named(tmp_path: Path) -> None:
    """A GGUF whose first tensor's data offset points past the end of the file."""
    import gguf

    from models.gguf import read_header

    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    offset_at = tensor.field.offset + sum(part.nbytes for part in tensor.field.parts[:-1])
    data = bytearray(path.read_bytes())
    data[offset_at:offset_at + 8] = (10 ** 9).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelError, match=rf"{re.escape(str(path))}: damaged or truncated GGUF file"):
        read_header(path)
