"""Every layout trains to the numbers of one device (float32)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from support.cases import tiered
from support.parity import PARAM_ATOL, assert_params_match, train_run

pytestmark = pytest.mark.xdist_group("layouts")  # they share compiled runs (support.parity)

LAYOUTS = [
    # (mesh, devices, overrides)
    ("dp=8", 8, {}),
    ("fsdp=8", 8, {}),
    ("tp=4", 4, {}),
    ("dp=2,fsdp=2,tp=2", 8, {}),
    ("dp=2,fsdp=4", 8, {}),  # HSDP
    ("dp=8", 8, {"zero": 1}),
    ("dp=8", 8, {"zero": 2}),
    ("dp=4,tp=2", 8, {"zero": 3}),
    ("", 1, {"grad_accum": 4}),
    ("dp=2,fsdp=2,tp=2", 8, {"grad_accum": 4}),
    ("dp=2,fsdp=4", 8, {"grad_accum": 4}),
    ("ep=2,sp=2,tp=2", 8, {}),
    # tp beyond the 4 kv heads: each kv head computed on the 2 devices that share it.
    ("tp=8", 8, {}),
    # Accumulation with sp: the per-shard vmap over the batch axes, ring attention inside.
    ("sp=2", 2, {"grad_accum": 2}),
    ("dp=2,sp=2", 4, {"grad_accum": 2}),
    # Sequence parallelism (zig-zag layout): ring attention on every sp layout; all-gather
    # (the same zig-zag chunks, the keys and values gathered) on two of them.
    *[(mesh, devices, {"attention": "ring"})
      for mesh, devices in (("sp=2", 2), ("sp=4", 4), ("sp=8", 8), ("sp=2,tp=2", 4), ("dp=2,fsdp=2,sp=2", 8))],
    *[(mesh, devices, {"attention": "all-gather"}) for mesh, devices in (("sp=4", 4), ("dp=2,fsdp=2,sp=2", 8))],
    # Megatron sequence parallelism: norms and residuals split along the sequence over tp.
    ("tp=2", 2, {"megatron_sp": True}),
    ("dp=2,sp=2,tp=2", 8, {"megatron_sp": True}),
]

# The spec asks for 1e-5 relative on the loss. Measured: at most ~3e-7, i.e. a few
# float32 roundings of sums taken in another order.
LOSS_RTOL = 1e-5
# Parameters: support.parity.assert_params_match says why its tolerances.


# The gate trains a layout per axis (and ZeRO's, accumulation's, ring and all-gather attention's,
# Megatron-SP's); the other layouts of a mechanism it trains once are slow. The floor pass
# repeats one layout per axis: the partitioner's programs differ between JAX versions.
@pytest.mark.parametrize("mesh,devices,overrides", tiered(
    LAYOUTS, [f"{m or '1dev'}{''.join(f'-{k}{v}' for k, v in o.items())}" for m, _, o in LAYOUTS],
    gate=["dp=8", "fsdp=8", "dp=2,fsdp=2,tp=2", "dp=8-zero1", "dp=4,tp=2-zero3", "1dev-grad_accum4", "tp=8",
          "ep=2,sp=2,tp=2", "sp=4-attentionring", "sp=4-attentionall-gather", "tp=2-megatron_spTrue"],
    floor=["dp=8", "fsdp=8", "dp=2,fsdp=2,tp=2", "dp=8-zero1", "1dev-grad_accum4", "ep=2,sp=2,tp=2",
           "sp=4-attentionring", "tp=2-megatron_spTrue"]))
def test_layout_matches_one_device(reference, mesh, devices, overrides):
    run = train_run(mesh, devices, **overrides)
    assert len(run.losses) >= 3
    np.testing.assert_allclose(run.losses, reference.losses, rtol=LOSS_RTOL, atol=0)
    # The loss must actually move, or matching it would prove little.
    assert reference.losses[-1] < reference.losses[0] - 0.05
    assert_params_match(run.params, reference.params)


# The other families (tests/hf's goldens' shapes and weights): Qwen3's per-head query and
# key norms, a head size of its own, tied embeddings (tp=4 goes beyond its 2 key/value
# heads); Qwen2's q/k/v biases split with the heads; Qwen3-MoE's dense and MoE layers
# with experts over ep (every other one, and the layers mlp_only_layers lists); Gemma 3's sliding and global layers over sp (its window of 6 over
# chunks of 8, so that whole chunk pairs are hidden; Mistral's windows over sp are checked
# against transformers' loss in test_hf), and in pipeline stages that hold different kinds
# (each chunk's layers' kinds read beside it: GPipe's, and DualPipe's, where device d also
# runs the mirrored stage p-1-d, received with its kinds).
DUALPIPE = {"pp_schedule": "dualpipe", "microbatches": 4}
FAMILY_LAYOUTS = [("qwen3", "dp=2,fsdp=2,tp=2", 8, {}), ("qwen3", "fsdp=2,tp=4", 8, {}), ("qwen2", "fsdp=2,tp=4", 8, {}),
                  ("qwen3-moe", "ep=2,fsdp=2", 4, {}), ("qwen3-moe-dense", "ep=2,fsdp=2", 4, {}),
                  ("gemma3", "sp=2,tp=2", 4, {}), ("gemma3", "pp=2,dp=2", 4, {}), ("gemma3", "pp=2", 2, DUALPIPE),
                  ("olmo2", "fsdp=2,tp=4", 8, {}), ("olmo2", "pp=2,dp=2", 4, {}),
                  ("olmo2", "tp=2", 2, {"megatron_sp": True, "remat": "full"})]  # norms after, Megatron-SP


@pytest.mark.parametrize("golden,mesh,devices,options", tiered(  # the gate keeps one family's layout
    FAMILY_LAYOUTS, [f"{g}-{m}" + "".join(f"-{v}" for v in o.values()) for g, m, _, o in FAMILY_LAYOUTS],
    gate=["qwen3-fsdp=2,tp=4"]))
def test_family_layout_matches_one_device(golden, mesh, devices, options):
    family = {"model": None, "init_from": str(Path(__file__).with_name("hf") / golden)}
    reference, run = train_run("", 1, **family), train_run(mesh, devices, **family, **options)
    assert reference.losses[-1] < reference.losses[0] - 0.05
    np.testing.assert_allclose(run.losses, reference.losses, rtol=LOSS_RTOL, atol=0)
    assert_params_match(*(_without_key_bias(r.params) for r in (run, reference)))
    if golden == "qwen2":
        # A key bias adds q.b to every score of a query alike, which the softmax ignores:
        # its gradient is 0 in exact arithmetic, so Adam turns rounding (1e-9) into steps
        # of up to lr in any direction, different on each layout (support.parity's PARAM_ATOL case;
        # measured up to 7e-6 here, on 6 of its 32 elements).
        key_bias = [r.params["blocks"]["attn"]["bkv"][..., 0, :] for r in (run, reference)]
        np.testing.assert_allclose(*key_bias, rtol=0, atol=PARAM_ATOL)


def _without_key_bias(params: dict) -> dict:
    """Qwen2's parameters with the value half of bkv only (the key half: see above)."""
    if "bkv" not in params["blocks"].get("attn", {}):
        return params
    attn = params["blocks"]["attn"] | {"bkv": params["blocks"]["attn"]["bkv"][..., 1, :]}
    return params | {"blocks": params["blocks"] | {"attn": attn}}


@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_bfloat16_compute_keeps_float32_master_weights(reference):
    run = train_run("dp=2,fsdp=2,tp=2", 8, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(run.params)} == {np.dtype("float32")}
    # bfloat16 keeps 8 bits of mantissa (~0.4% per rounding); over a 2-layer forward pass
    # the loss stays within 1% of float32. This checks the mixed-precision path, not parity.
    np.testing.assert_allclose(run.losses, reference.losses, rtol=1e-2)
    assert not np.array_equal(run.losses, reference.losses)  # it really computed in bf16


@pytest.mark.parametrize("mesh", ["dp=2,tp=8", "dp=4,tp=8"])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_tp_beyond_the_kv_heads_trains_like_one_device_from_the_command_line(tmp_path, mesh):
    """The design card's `--mesh dp=4,tp=8` on the default model (4 kv heads), on 32
    emulated devices, against one device."""
    losses = {}
    for name, args in (("one", []), ("mesh", ["--mesh", mesh])):
        metrics = tmp_path / f"{name}.jsonl"
        cmd = [sys.executable, "-m", "spmd.train", *args, "--steps", "3", "--log-every", "1",
               "--metrics-file", str(metrics)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        losses[name] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses["mesh"]) == 3
    np.testing.assert_allclose(losses["mesh"], losses["one"], rtol=LOSS_RTOL, atol=0)
