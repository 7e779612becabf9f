"""spmd.run.xla_flags: the GPU flags exist in the installed jaxlib, the user's own settings win,
the combining thresholds follow the model, and the CPU gets nothing."""

import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from models import PRESETS, model_class
from spmd.base import accelerators
from spmd.config import TrainConfig, validate
from spmd.parallel.skeleton import model_skeleton
from spmd.run import xla_flags

ROOT = Path(__file__).resolve().parent.parent

# Imports jax first and sets XLA_FLAGS only then, as the trainer does: XLA reads them when
# the backend starts. The device count proves XLA parsed the variable that holds every GPU flag.
LATE_FLAGS = """
import os
import jax
from models import PRESETS
from spmd.run import xla_flags
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
xla_flags.configure("gpu", PRESETS["llama3.2-1b"], "bfloat16")
print(len(jax.devices()), jax.devices()[0].platform)
print(os.environ["XLA_FLAGS"])
"""


def test_every_gpu_flag_is_known_to_this_jaxlib():
    """XLA aborts at backend start on an unknown flag in XLA_FLAGS, and its flag registry
    is shared by all backends: a CPU backend started with every GPU flag must come up."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    env["JAX_PLATFORMS"] = "cpu"
    result = subprocess.run([sys.executable, "-c", LATE_FLAGS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    count, flags = result.stdout.strip().splitlines()[-2:]
    assert count == "3 cpu"
    assert xla_flags.flag_names(flags) == {"xla_force_host_platform_device_count"} | \
        xla_flags.flag_names(" ".join(xla_flags.gpu_flags(PRESETS["llama3.2-1b"], "bfloat16")))


def test_flags_newer_than_the_jaxlib_are_left_out():
    """XLA aborts on a flag it does not know: the all-reduce splitter's flag is in jaxlib
    0.12 (this CI's newest) and not in 0.10.2 (its floor)."""
    newest = xla_flags.flag_names(" ".join(xla_flags.gpu_flags(PRESETS["tiny"], "bfloat16", "0.12.0.1")))
    floor = xla_flags.flag_names(" ".join(xla_flags.gpu_flags(PRESETS["tiny"], "bfloat16", "0.10.2")))
    assert newest - floor == set(xla_flags.GPU_FLAGS_SINCE)


def test_the_users_own_setting_wins():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_all_gather_combine_threshold_bytes=123"
    environ = {"XLA_FLAGS": mine}
    lines = xla_flags.configure("gpu", PRESETS["tiny"], "bfloat16", environ)
    flags = environ["XLA_FLAGS"].split()
    assert flags[:2] == mine.split()  # kept, first, with the user's values
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert not any(f.startswith("--xla_gpu_all_gather_combine_threshold_bytes=") for f in flags[2:])
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
    assert any("left as you set them" in line and "xla_gpu_enable_latency_hiding_scheduler" in line for line in lines)
    # Again: everything is named now, so nothing changes.
    again = xla_flags.configure("gpu", PRESETS["tiny"], "bfloat16", environ)
    assert len(again) == 1 and again[0].startswith("XLA_FLAGS: left as you set them")
    assert environ["XLA_FLAGS"].split() == flags


def test_tpu_flags_go_to_libtpu_init_args():
    environ = {"LIBTPU_INIT_ARGS": "--xla_tpu_enable_async_collective_fusion=false"}
    xla_flags.configure("tpu", PRESETS["tiny"], "bfloat16", environ)
    assert "XLA_FLAGS" not in environ
    args = environ["LIBTPU_INIT_ARGS"].split()
    assert args[0] == "--xla_tpu_enable_async_collective_fusion=false"
    assert xla_flags.flag_names(" ".join(args)) == set(xla_flags.TPU_FLAGS)
    assert len(args) == len(xla_flags.TPU_FLAGS)
    # The all-gather fusion libtpu takes on v5e alone: added where the TPU VM says v5e.
    fused = set(xla_flags.TPU_V5E_FLAGS)
    for accelerator, wanted in (("v5litepod-16", fused), ("v5p-128", set()), ("v6e-8", set())):
        environ = {"TPU_ACCELERATOR_TYPE": accelerator}
        xla_flags.configure("tpu", PRESETS["tiny"], "bfloat16", environ)
        assert xla_flags.flag_names(environ["LIBTPU_INIT_ARGS"]) - set(xla_flags.TPU_FLAGS) == wanted, accelerator


@pytest.mark.parametrize("model", ["tiny", "moe-tiny", "llama3.2-1b"])
def test_threshold_is_one_layer_of_the_model(model):
    cfg = PRESETS[model]
    blocks = model_skeleton(model).shapes[model_class(cfg).STACKED]
    per_layer = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(blocks)) // cfg.layers
    assert xla_flags.layer_params(cfg) == per_layer
    assert xla_flags.combine_threshold_bytes(cfg, "bfloat16") == 2 * per_layer
    assert xla_flags.combine_threshold_bytes(cfg, "float32") == 4 * per_layer
    assert xla_flags.combine_threshold_bytes(cfg, jax.numpy.bfloat16) == 2 * per_layer


def test_thresholds_scale_with_the_model():
    small, large = PRESETS["llama3.2-1b"], PRESETS["llama3-8b"]
    assert xla_flags.combine_threshold_bytes(small, "bfloat16") == 2 * 60_821_504
    assert xla_flags.combine_threshold_bytes(large, "bfloat16") == 2 * 218_112_000
    environ = {}
    xla_flags.configure("gpu", large, "bfloat16", environ)
    for name in xla_flags.GPU_THRESHOLD_FLAGS:
        assert f"--{name}={2 * 218_112_000}" in environ["XLA_FLAGS"].split()


def test_cpu_sets_nothing():
    environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_flags.configure("cpu", PRESETS["llama3-8b"], "bfloat16", environ) == []
    assert environ == {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def test_backend_is_told_before_jax_starts(monkeypatch):
    assert xla_flags.backend_before_start({"JAX_PLATFORMS": "cpu"}) == "cpu"
    assert xla_flags.backend_before_start({"JAX_PLATFORMS": "cuda,cpu"}) == "gpu"
    assert xla_flags.backend_before_start({"JAX_PLATFORMS": "tpu"}) == "tpu"
    # A plugin counts where the host shows its device (this host shows none).
    monkeypatch.setattr(accelerators, "installed_plugins", lambda: {"gpu", "tpu"})
    monkeypatch.setattr(accelerators, "device_visible", lambda platform: True)
    assert xla_flags.backend_before_start({}) == "gpu"
    monkeypatch.setattr(accelerators, "device_visible", lambda platform: platform == "tpu")
    assert xla_flags.backend_before_start({}) == "tpu"
    monkeypatch.setattr(accelerators, "device_visible", lambda platform: False)
    assert xla_flags.backend_before_start({}) == "cpu"
    assert accelerators.unused_plugins({}) and not accelerators.unused_plugins({"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("fields,double_buffered", [
    ({"mesh": "pp=2", "pp_schedule": "zb-v", "layers": 4}, False),
    ({"mesh": "pp=2", "pp_schedule": "dualpipe", "microbatches": 4, "batch": 8}, False),
    ({"mesh": "pp=2", "pp_schedule": "zb-v", "layers": 4, "remat": "full"}, True),
    ({"mesh": "pp=2", "pp_schedule": "1f1b"}, True),
    ({"mesh": "dp=2"}, True),
])
def test_loops_are_not_double_buffered_where_the_pipeline_defers_weight_gradients(fields, double_buffered):
    """zb-v and DualPipe under --remat none carry rings through branches that do not write
    them: a double-buffered loop had XLA:GPU copy them in every trip (xla_flags.double_buffers)."""
    cfg = validate(TrainConfig.of(**{"model": "tiny", "remat": "none", **fields}))
    assert xla_flags.double_buffers(cfg) is double_buffered
    environ = {}
    lines = xla_flags.configure("gpu", cfg.model_cfg, "bfloat16", environ, double_buffered=xla_flags.double_buffers(cfg))
    value = "true" if double_buffered else "false"
    assert f"--xla_gpu_enable_while_loop_double_buffering={value}" in environ["XLA_FLAGS"].split()
    assert any("not double-buffered" in line for line in lines) is not double_buffered
