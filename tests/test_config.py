"""Config composition: every option of every group composes and validates; bad input fails clearly."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from exporters.config import CONF_DIR, ExportConfig
from exporters.export import checked_config as to_typed
from exporters.config.resolvers import parallel_jobs, ray_temp_dir
from exporters.errors import UserError
from tests.helpers import compose_config

GROUPS = {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) for group in ("model", "quant", "backend")}


def test_groups_have_the_required_options() -> None:
    assert {"tiny", "llama"} <= set(GROUPS["model"])
    assert {"fp32", "fp16", "bf16", "8da4w", "8da8w"} <= set(GROUPS["quant"])
    assert {"portable", "xnnpack", "coreml", "vulkan", "openvino"} <= set(GROUPS["backend"])


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes_against_the_schema(group: str, option: str) -> None:
    backend = "backend=coreml" if option in ("4w", "8w") else "backend=xnnpack"
    if option.startswith("pt2e_"):  # a backend's own quantizer: pt2e_<backend>_...
        backend = f"backend={option.split('_')[1]}"
    extra = [backend] if group == "quant" else []
    if option in ("pt2e_xnnpack_static", "pt2e_coreml_8a_c8w", "pt2e_coreml_8a_c4w"):  # refused unless asked for
        extra.append("quant.allow_static_activations=true")
    if backend in ("backend=coreml", "backend=vulkan") and extra or option in ("coreml", "vulkan", "openvino"):
        # static shapes: no stock runner runs them
        extra.append("export.layout=split")
    cfg = compose_config(f"{group}={option}", *extra)
    assert getattr(cfg, group).name == option, "each option file names itself"
    typed = to_typed(cfg)
    assert isinstance(typed, ExportConfig)


def test_defaults_are_tiny_fp32_xnnpack() -> None:
    cfg = to_typed(compose_config())
    assert (cfg.model.name, cfg.quant.name, cfg.backend.name) == ("tiny", "fp32", "xnnpack")
    assert cfg.export.methods == ["prefill", "decode", "forward"] and cfg.validate
    assert (cfg.backend.attention, cfg.backend.dynamic_shapes) == ("custom_ops", True)


def test_fields_can_be_overridden_from_the_command_line() -> None:
    cfg = to_typed(compose_config("quant=8da4w", "quant.group_size=64", "export.max_seq_len=256",
                                  "export.methods=[prefill,decode,forward]"))
    assert cfg.quant.group_size == 64 and cfg.export.max_seq_len == 256
    assert cfg.export.methods == ["prefill", "decode", "forward"]


def test_unknown_group_option_lists_the_available_ones() -> None:
    with pytest.raises(MissingConfigException) as err:
        compose_config("quant=9da9w")
    assert "8da4w" in str(err.value) and "fp32" in str(err.value)


def test_unknown_field_is_named() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("quant.grup_size=64")
    assert "grup_size" in str(err.value.__cause__ or err.value)


def test_wrong_type_is_named() -> None:
    with pytest.raises(ConfigCompositionException) as err:
        compose_config("export.max_seq_len=lots")
    cause = err.value.__cause__
    assert isinstance(cause, ValidationError) and "max_seq_len" in str(cause)


def test_typo_inside_an_option_file_fails_at_composition(tmp_path) -> None:
    """A field the schema does not know, written in a YAML option file, is refused."""
    import shutil

    from hydra import compose, initialize_config_dir

    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "quant" / "bad.yaml").write_text("name: bad\nlinear: 8da4w\ngroupsize: 32\n")
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as err:
            compose(config_name="config", overrides=["quant=bad"])
    assert "Key 'groupsize' not in 'QuantConfig'" in str(err.value)


def test_int8_activations_from_bf16_are_refused_before_any_work() -> None:
    """No ExecuTorch kernel quantizes bf16 activations to int8 (emit failed with "Missing out variants"): refused at
    the start with the dtypes that work; fp16 exports (tests/test_quant_backends.py runs fp16 programs)."""
    with pytest.raises(UserError, match=r"quant.dtype=bf16 quantizes activations.*8da4w.*fp32 \(the default\) or fp16"):
        to_typed(compose_config("quant=8da4w", "quant.dtype=bf16"))
    to_typed(compose_config("quant=8da4w", "quant.dtype=fp16"))
    to_typed(compose_config("quant=bf16"))


def test_pair_that_cannot_run_is_refused_with_the_working_pairs() -> None:
    with pytest.raises(UserError) as err:
        to_typed(compose_config("backend=portable", "quant=8da4w"))
    msg = str(err.value)
    assert "quant=8da4w asks for linear 8da4w, which backend=portable cannot run" in msg
    assert "linear/lm_head schemes none;" in msg and "embedding schemes none, 4w, 8w" in msg


@pytest.mark.parametrize("overrides,role", [
    (("backend=vulkan", "quant=fp16"), "dtype fp16"),
    (("backend=xnnpack", "quant=fp32", "quant.lm_head=4w"), "lm_head 4w"),
    (("backend=vulkan", "quant.embedding=4w"), "embedding 4w"),
])
def test_each_part_of_a_quant_scheme_is_checked_against_the_backend(overrides, role) -> None:
    with pytest.raises(UserError, match=role):
        to_typed(compose_config(*overrides))


def test_lm_head_follows_linear_unless_overridden() -> None:
    cfg = to_typed(compose_config("quant=8da4w"))
    assert (cfg.quant.lm_head, cfg.quant.lm_head_group_size) == ("8da4w", 32)
    cfg = to_typed(compose_config("quant=8da4w", "quant.lm_head=8da8w", "quant.lm_head_group_size=0"))
    assert (cfg.quant.lm_head, cfg.quant.lm_head_group_size) == ("8da8w", 0)
    assert to_typed(compose_config("quant=8da4w", "quant.lm_head=null")).quant.lm_head is None


@pytest.mark.parametrize("override,named", [
    ("export.methods=[prefil]", "prefil"),
    ("export.methods=[]", "export.methods"),
    ("export.max_seq_len=1", "max_seq_len"),
    ("quant.group_size=-1", "group_size"),
    ("validation.prompt_tokens=0", "prompt_tokens"),
    ("validation.max_tokens=2", "max_tokens"),
    ("benchmark.steps=0", "benchmark.steps"),
    ("backend=coreml export.layout=split export.methods=[prefill]", "without decode nothing in the program takes one"),
    ("search.objective=size", "search.objective='size' is not known. Allowed: size_mb"),
    ("bench=true backend=coreml export.layout=split", "bench=true: backend=coreml's delegate cannot run"),
])
def test_bad_values_are_refused_before_any_work(override: str, named: str) -> None:
    cfg = compose_config(*override.split())
    with pytest.raises(UserError, match=named):
        to_typed(cfg)


@pytest.mark.parametrize("override,allowed", [
    ("quant.algorithm=minmax", "hqq, affine, gptq, signround, distill"),
    ("quant.dtype=fp64", "fp32, fp16, bf16"),
    ("export.layout=ours", "stock, split"),
    ("export.tied_embedding=once", "shared, copied"),
    ("export.weights=outside", "program, external"),
    ("backend.attention=flash", "aten, custom_ops"),
    ("model.source=hub", "hf, tiny"),
])
def test_a_value_outside_a_closed_set_fails_at_composition_listing_the_allowed(override: str, allowed: str) -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as failure:
        compose_config(override)
    assert f"expected one of [{allowed}]" in str(failure.value.__cause__)


@pytest.mark.parametrize("overrides,named", [
    (["+model.foo=3", "+export.bar=1"], "model.foo; export.bar"),
    (["+quant.grup_size=64"], "quant.grup_size (did you mean quant.group_size?)"),
    (["+validation.max_token=3"], "validation.max_tokens?"),
    (["+verbos=true"], "verbos (did you mean verbose?)"),
    (["+quant.max_ppl_increase=0.1"], "quant.max_ppl_increase was renamed quant.max_ppl_drift"),
])
def test_a_key_added_with_plus_that_the_schema_lacks_is_refused(overrides: list[str], named: str) -> None:
    """``+key=value`` bypasses Hydra's schema check; the export refuses the key instead of ignoring it."""
    with pytest.raises(UserError, match="unknown config key") as failure:
        to_typed(compose_config(*overrides))
    assert named in str(failure.value)


def test_backend_options_take_any_key() -> None:
    """backend.options is passed to the partitioner as it is: the one place new keys belong."""
    assert to_typed(compose_config("+backend.options.per_op_mode=true")).backend.options == {"per_op_mode": True}


@pytest.mark.parametrize("methods", ["[prefill,decode]", "[decode]"])
def test_stock_layout_refuses_methods_a_stock_runner_cannot_run(methods: str) -> None:
    """No forward: 1.4.1's runner stops with an error; the export says so before any work, and the fix."""
    with pytest.raises(UserError, match=r"ExecuTorch 1\.4\.1 stock runner: fails .*Add forward to export.methods, or "
                                        r"set export.layout=split"):
        to_typed(compose_config(f"export.methods={methods}"))
    assert to_typed(compose_config(f"export.methods={methods}", "export.layout=split")).export.layout == "split"


@pytest.mark.parametrize("backend", ["coreml", "vulkan"])
def test_stock_layout_refuses_static_shape_backends(backend: str) -> None:
    with pytest.raises(UserError, match=r"takes a fixed chunk.*static shapes .*set export.layout=split"):
        to_typed(compose_config(f"backend={backend}"))


@pytest.mark.parametrize("content,named", [(None, "no such file"), ("", "is empty"), ("  \n", "is empty")])
def test_a_bad_validation_text_file_is_refused_before_any_work(tmp_path, content, named: str) -> None:
    path = tmp_path / "text.txt"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UserError, match=f"validation.text_file={path}: {named}|validation.text_file={path} {named}"):
        to_typed(compose_config(f"validation.text_file={path}"))


def test_a_validation_text_too_short_to_score_is_one_clear_error(tmp_path) -> None:
    from exporters.export import export

    path = tmp_path / "short.txt"
    path.write_text("Too short.")
    with pytest.raises(UserError, match=r"validation text \(.*short.txt\) is \d+ tokens long; it needs at least"):
        export(compose_config(f"validation.text_file={path}"), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.pte"))


@pytest.mark.parametrize("launcher", sorted(p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")))
def test_launcher_presets_compose_and_resolve(launcher: str) -> None:
    """Each preset extends its plugin's launcher config; the sizes it computes from sweep.job_memory_gb resolve."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={launcher}", "sweep.job_memory_gb=3"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    settings = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert settings["_target_"].startswith("hydra_plugins.")
    if launcher == "local_parallel":
        assert 1 <= settings["n_jobs"] <= (os.cpu_count() or 1)
    if launcher == "slurm":
        assert settings["mem_gb"] == 3
    if launcher == "ray_cluster":
        assert settings["ray"]["remote"] == {"max_retries": 0, "num_cpus": 1, "memory": 3 * 1024**3}
        assert settings["ray"]["init"]["include_dashboard"] is False


def test_parallel_jobs_fit_in_memory() -> None:
    assert parallel_jobs(10**6) == 1  # never zero, even when one job needs more than the machine has
    assert parallel_jobs(1) == os.cpu_count()


def test_ray_temp_dir_stays_in_the_sweep_folder_only_where_its_sockets_fit() -> None:
    assert ray_temp_dir("/tmp/sw1") == "/tmp/sw1/.ray"
    assert ray_temp_dir("/tmp/" + "x" * 60) == "/tmp/ray"


def test_search_config_composes_with_the_optuna_sweeper() -> None:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="search", return_hydra_config=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.search.max_ppl_increase == 0.25
    to_typed(compose_config("search.max_ppl_increase=0.1", "search.objective=decode_tok_s"))
