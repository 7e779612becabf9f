"""Every preset in mesh_configs/ plans cleanly and fits the hardware it names.

Each is planned as a user would (`python -m spmd.plan --config FILE --json`): the real
step compiled for the preset's mesh on emulated CPU devices (up to 128 here). The commands
run in one driver (tests/cli_driver.py), each in its own forked process: one import of
JAX for all of them.
"""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml
from support.cases import tiered

from spmd.parallel.checks import check_layout
from spmd.run.resolve import parse_args

pytestmark = pytest.mark.xdist_group("presets")  # the tests read one driver's results

ROOT = pathlib.Path(__file__).parents[1]
DRIVER = pathlib.Path(__file__).with_name("cli_driver.py")
# A preset kept to plan: 2,048 devices, too many to compile in the suite's time
# (docs/deepseek.md has its plan).
PLAN_ONLY = {ROOT / "mesh_configs" / "deepseek-v3-2048xh800.yaml"}
PRESETS = sorted(p for p in ROOT.joinpath("mesh_configs").glob("*.yaml")
                 if "hardware" in yaml.safe_load(p.read_text()) and p not in PLAN_ONLY)


def test_the_presets_cover_the_documented_set_ups():
    meshes = {p.stem: yaml.safe_load(p.read_text()) for p in PRESETS}
    kinds = {
        "one GPU": lambda c: not c["mesh"],
        "8 GPUs, FSDP": lambda c: c["mesh"] == {"fsdp": 8},
        "2 nodes, dp over the network, FSDP inside": lambda c: c.get("dcn") == {"dp": 2} and "fsdp" in c["mesh"],
        "a TPU v5p slice": lambda c: c["hardware"] == "v5p",
        "TP=8, PP=4, DP=4": lambda c: c["mesh"] == {"pp": 4, "dp": 4, "tp": 8},
        "expert parallel": lambda c: c["mesh"].get("ep", 1) > 1,
        "long context on one node": lambda c: c["mesh"].get("sp", 1) > 1 and c["seq"] >= 32768 and "dcn" not in c,
        "DeepSeek-V3's pp x ep x ZeRO-1": lambda c: c["mesh"].get("pp", 1) > 1 and c["mesh"].get("ep", 1) > 1
        and c.get("zero") == 1,
    }
    missing = [kind for kind, is_it in kinds.items() if not any(map(is_it, meshes.values()))]
    assert not missing


@pytest.fixture(scope="module")
def plans(request) -> dict:
    """The plans of this session's presets (those of the tier run), in one driver."""
    chosen = [item.callspec.params["preset"] for item in request.session.items
              if item.module is request.module and item.originalname == "test_preset_plans_cleanly_and_fits"]
    cases = [{"module": "spmd.plan", "argv": ["--config", str(p), "--json"], "cwd": str(ROOT)} for p in chosen]
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(zip(chosen, json.loads(done.stdout)))


# Plans of up to 128 emulated devices: the gate keeps one preset, the README's.
@pytest.mark.parametrize("preset", tiered(PRESETS, lambda p: p.stem, gate=["llama3-8b-8xh100"]))
def test_preset_plans_cleanly_and_fits(plans, preset):
    out = plans[preset]
    assert out["code"] == 0, out["stderr"][-2000:]
    plan = json.loads(out["stdout"])
    assert plan["hardware"] == yaml.safe_load(preset.read_text())["hardware"]
    assert plan["fits"] is True, plan["per_device"]
    # Every collective the layout should emit is there, within 5% of its theory (measured:
    # 1.00 on every row), and nothing else moves more than scalars.
    expected = [c for c in plan["collectives"] if c["theory_bytes_per_device"]]
    assert bool(expected) == (plan["devices"] > 1)
    for c in expected:
        assert c["bytes_per_device"] == pytest.approx(c["theory_bytes_per_device"], rel=0.05), c
    assert not [c for c in plan["collectives"] if c.get("unexpected")]
    assert 0 < plan["predicted_step_time_s"] and 0 < plan["predicted_mfu"] < 1


@pytest.mark.parametrize("preset", sorted(PLAN_ONLY), ids=lambda p: p.stem)
def test_plan_only_preset_passes_every_check_before_compiling(preset):
    """Its layout divides (DeepSeek-V3's 58 MoE layers and 6 empty ones into DualPipe's 16
    stages, the batch into 128 microbatches x 128 batch shards, 256 experts over ep=64,
    the embed dimension for ZeRO-1 over dp x ep), as `spmd.plan` checks it
    before compiling."""
    cfg = parse_args(["--config", str(preset)])
    shape = cfg.parallelism.mesh_spec.resolve(cfg.parallelism.mesh_spec.devices)
    _, skeleton, schedule = check_layout(cfg.step, shape, for_training=True)
    assert (schedule.name, schedule.stages, schedule.repeats) == ("dualpipe", 16, 1)
    assert skeleton.model_cfg.stacked_layers == 16 * 4
