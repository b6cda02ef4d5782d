import pytest

from harness.kv_paths.spec import PathSpecError, parse_path, parse_paths


@pytest.mark.parametrize("spec, fmt, granularity, source, saturate, current_chunk", [
    ("bf16", "bf16", "per_tensor", "default", True, True),
    ("fp8", "e4m3", "per_tensor", "default", True, True),
    ("fp8_e4m3:per_head:calibrated", "e4m3", "per_head", "calibrated", True, True),
    ("fp8_e5m2:per_token", "e5m2", "per_token", "dynamic", True, True),
    ("fp8_e5m2:checkpoint", "e5m2", "per_tensor", "checkpoint", True, True),  # class 5: valid, never refused
    ("fp8_e4m3:nosat:raw_prefill:warmup", "e4m3", "per_tensor", "warmup", False, False),  # options in any order
    ("bf16:checkpoint", "bf16", "per_tensor", "checkpoint", True, True),  # class 3: scales present, cache bf16
    (" fp8_e4m3 : per_head ", "e4m3", "per_head", "default", True, True),
    ("nvfp4:prefill=fp8_e4m3", "nvfp4", "per_tensor", "default", True, False),  # a prefill format of its own
    ("mxfp8:prefill=fp8_e4m3:calibrated", "mxfp8", "per_tensor", "calibrated", True, False),  # the prefill's scale
    ("vllm:fp8_ds_mla", "ds_mla_e4m3", "per_tensor", "dynamic", True, True),
    ("fp8:keep_bf16=2+sliding_window:hadamard", "e4m3", "per_tensor", "default", True, True),
    ("k=fp8_e4m3/v=bf16", "e4m3", "per_tensor", "default", True, True),
])
def test_parse_valid(spec, fmt, granularity, source, saturate, current_chunk):
    path = parse_path(spec)
    assert (path.fmt, path.granularity, path.scale_source, path.saturate, path.quantize_current_chunk) == (
        fmt, granularity, source, saturate, current_chunk)
    assert parse_path(path.canonical).canonical == path.canonical  # canonical form parses to itself


@pytest.mark.parametrize("spec, reason", [
    ("", "empty KV path spec"),
    ("fp9", "unknown cache format 'fp9'"),
    ("int8:per_head", "unknown cache format 'int8'"),
    ("fp8:per_chanel", "unknown option 'per_chanel'"),
    ("fp8:per_head:per_token", "sets granularity twice"),
    ("fp8:calibrated:checkpoint", "sets scale_source twice"),
    ("fp8:per_token:calibrated", "per_token scales are computed from each token"),
    ("fp8_e5m2:sat:nosat", "sets cast twice"),
    ("fp32:calibrated", "fp32 is the reference in float32"),
    ("fp8:prefill=fp9", "unknown prefill format 'fp9' \\(--prefill-kv-cache-dtype\\)"),
    ("fp8:prefill=", "prefill= needs the format a prefill chunk attends in"),
    ("fp8:raw_prefill:prefill=nvfp4", "sets prefill twice"),
    ("fp8:prefill=nvfp4:prefill=mxfp8", "sets prefill twice"),
    ("fp8:prefill=fp8_ds_mla", "fp8_ds_mla is a latent layout"),
    ("vllm:nvfp4:prefill=fp8_inc", "vllm --prefill-kv-cache-dtype fp8_inc is refused"),
    ("fp8:keep_bf16=sliding", "keep_bf16 takes layer indices and sliding_window"),
    ("fp8:keep_bf16=", "keep_bf16= names no layer"),
    ("fp8:keep_bf16=1:keep_bf16=sliding_window", "sets the per-layer precision map twice"),
    ("fp8:hadamard:hadamard", "sets rotation twice"),
    ("fp8:kernel=dequant:hadamard", "hadamard stores rotated K"),
    ("fp8_e4m3:emulated:hadamard", "emulated takes a format"),
    ("k=bf16/v=fp9", "unknown V format 'fp9'"),
    ("fp8_ds_mla:calibrated", "has none: its scales"),
])
def test_parse_errors_name_the_reason(spec, reason):
    with pytest.raises(PathSpecError, match=reason):
        parse_path(spec)


def test_parse_paths_lists_and_duplicates():
    assert [p.name for p in parse_paths("bf16, fp8_e4m3")] == ["bf16", "fp8_e4m3"]
    assert [p.name for p in parse_paths(["bf16", "fp8_e5m2,fp8"])] == ["bf16", "fp8_e5m2", "fp8"]
    with pytest.raises(PathSpecError, match="listed twice: bf16"):
        parse_paths("bf16,fp8,bf16")
    with pytest.raises(PathSpecError, match="no KV paths"):
        parse_paths(" , ")


def test_describe_says_scales_are_ignored_on_bf16():
    assert "ignored" in parse_path("bf16:checkpoint").describe()
    assert "1.0" in parse_path("fp8").describe()


def test_fp32_is_the_reference_in_float32():
    path = parse_path("fp32")
    assert path.is_reference_noise and not path.is_fp8 and path.canonical == "fp32"
    assert "precision noise" in path.describe()


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
def test_a_layer_map_that_is_not_a_regular_file_is_refused(tmp_path, target):
    """Issue 45: `layers=` on a FIFO waited forever; `layers=/dev/zero` read without bound. Run in a child with a
    deadline and a 2 GiB address-space cap, as before the fix either never returned."""
    import os
    import resource
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "map.json" if target == "fifo" else Path(target)
    if target == "fifo":
        os.mkfifo(path)
    code = ("from harness.kv_paths.spec import parse_path, PathSpecError\n"
            f"try:\n    parse_path('fp8_e4m3:layers={path}')\nexcept PathSpecError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)))
    assert done.returncode == 0 and f"layer map {path}: not a regular file" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("spec, named", [
    ("fp8:prefill=fp9", "unknown prefill format 'fp9'"),
    ("nvfp4:keep_bf16=sliding", "keep_bf16 takes layer indices and sliding_window"),
    ("vllm:nvfp4:prefill=fp8_inc", "--prefill-kv-cache-dtype fp8_inc is refused"),
    ("fp8:hadamard:kernel=dequant", "hadamard stores rotated K"),
])
def test_a_hostile_path_spec_exits_2_naming_the_flag_and_value(tiny_models, tmp_path, capsys, spec, named):
    from harness.cli import main

    code = main(["run", "--paths", spec, "--model", str(tiny_models["gqa"]), "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"--paths: KV path {spec!r}" in err and named in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_keep_bf16_sliding_window_on_a_model_without_one_exits_2_before_work(tiny_models, tmp_path, capsys):
    from harness.cli import main

    code = main(["run", "--paths", "fp8_e4m3:keep_bf16=sliding_window", "--model", str(tiny_models["gqa"]),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "keep_bf16=sliding_window" in err and "'llama' has none" in err, err
    assert not (tmp_path / "out").exists()
