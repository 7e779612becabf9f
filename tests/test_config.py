"""Flags, YAML presets, the mesh flag and the rules table."""

import pathlib

import jax
import pytest

from spmd.base.errors import UserError
from spmd.config import parse_args
from spmd.parallel.mesh import parse_mesh, resolve_mesh
from spmd.parallel.rules import make_rules, spec_for

ROOT = pathlib.Path(__file__).parents[1]


def test_flags_override_the_yaml_file(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("mesh: {dp: 2, tp: 4}\ndcn: {dp: 2}\nsteps: 7\nlr: 0.01\nscale_lr: true\n")
    cfg = parse_args(["--config", str(file), "--steps", "9"])
    assert ((cfg.parallelism.mesh, cfg.parallelism.dcn, cfg.training.steps, cfg.optimizer.lr, cfg.optimizer.scale_lr)
            == ("dp=2,tp=4", "dp=2", 9, 0.01, True))


def test_a_yaml_file_by_sections_is_the_flat_one(tmp_path):
    """Every option belongs to one section (spmd.run.config.SECTIONS); a preset rewritten
    with its keys under their sections gives the same options; a key under another
    section's name, or given both ways, is refused in one line; --help lists them by section."""
    import yaml

    from spmd.config import train_parser
    from spmd.run.config import SECTION_OF, SECTIONS, cli_options

    assert sorted(SECTION_OF) == sorted(option for option, _ in cli_options())
    assert sum(map(len, SECTIONS.values())) == len(SECTION_OF)
    flat = yaml.safe_load((ROOT / "mesh_configs" / "deepseek-v3-2048xh800.yaml").read_text())
    nested: dict = {}
    for key, value in flat.items():
        nested.setdefault(SECTION_OF[key], {})[key] = value
    assert {"model", "parallelism", "moe", "optimizer"} <= set(nested)
    file = tmp_path / "nested.yaml"
    file.write_text(yaml.safe_dump(nested, sort_keys=False))
    assert parse_args(["--config", str(file)]) == parse_args(["--config", str(ROOT / "mesh_configs" / "deepseek-v3-2048xh800.yaml")])
    for wrong, message in (({"optimizer": {"steps": 3}}, "optimizer.steps is an option of the training section"),
                           ({"lora": {"rank": 3}}, "lora.rank is no option"),
                           ({"training": {"steps": 3}, "steps": 4}, "steps and steps are one option, given twice")):
        file.write_text(yaml.safe_dump(wrong))
        with pytest.raises(UserError, match=message):
            parse_args(["--config", str(file)])
    assert "optimizer options:" in train_parser().format_help()


def test_the_options_are_held_and_handed_down_by_section():
    """The run's options object is its sections, one dataclass each (10 fields where there
    were 83 flat ones); flat names reach every option (`TrainConfig.of`, `.replace`,
    `.record`, as the command line and a checkpoint's record have them); the layout, the
    program and the planner take the step's sections (`TrainConfig.step`) and refuse the
    whole set, which holds the data, checkpoint, logging and processes sections besides."""
    import dataclasses

    from spmd.config import TrainConfig, validate
    from spmd.parallel.layout import make_layout
    from spmd.parallel.step import build_program
    from spmd.planner.plan import make_plan
    from spmd.run.config import SECTIONS
    from spmd.run.options import OPTIONS

    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(SECTIONS)
    assert all(dataclasses.is_dataclass(f.default_factory) for f in dataclasses.fields(TrainConfig))
    cfg = validate(TrainConfig.of(model="tiny", data="notes.txt", lr=1e-3, mesh="dp=1", steps=5, mtp_weight=0.3))
    assert (cfg.model.preset, cfg.data.path, cfg.optimizer.lr, cfg.training.steps) == ("tiny", "notes.txt", 1e-3, 5)
    assert cfg.replace(lr=2e-3, remat="full").optimizer.lr == 2e-3 and cfg.optimizer.lr == 1e-3
    assert set(cfg.record()) == set(OPTIONS) and cfg.record()["model"] == "tiny"
    with pytest.raises(TypeError, match="no option named 'rank'"):
        cfg.replace(rank=4)
    step = cfg.step
    assert [f.name for f in dataclasses.fields(step)] == [
        "model", "training", "optimizer", "parallelism", "moe", "lora", "model_cfg"]
    assert step.model_cfg is cfg.model_cfg  # resolved once
    for lower in (lambda c: make_layout(c, jax.devices()[:1]), lambda c: build_program(c, None),
                  lambda c: make_plan(c, None)):
        with pytest.raises(TypeError, match=r"TrainConfig\.step\), not TrainConfig"):
            lower(cfg)
    assert make_layout(step, jax.devices()[:1]).shape["dp"] == 1


def test_every_preset_file_is_a_valid_config():
    presets = sorted(ROOT.joinpath("mesh_configs").glob("*.yaml"))
    assert presets
    for preset in presets:
        cfg = parse_args(["--config", str(preset)])
        parse_mesh(cfg.parallelism.mesh)


def test_mesh_flag_fills_unnamed_axes_and_the_rest():
    assert resolve_mesh(parse_mesh("dp=-1,tp=2"), 8) == {"pp": 1, "dp": 4, "fsdp": 1, "ep": 1, "sp": 1, "tp": 2}
    with pytest.raises(UserError, match="only one mesh axis may be -1"):
        parse_mesh("dp=-1,tp=-1")
    with pytest.raises(UserError, match="do not divide"):
        resolve_mesh(parse_mesh("dp=-1,tp=3"), 8)


@pytest.mark.parametrize("zero,params,grads,opt", [
    # fsdp and sp (whose devices see other tokens, as fsdp's) split the weights' embed.
    (0, ("fsdp", "sp"), ("fsdp", "sp"), ("fsdp", "sp")),
    # In one fused step ZeRO-1 gradients go straight to the optimizer's shards, as ZeRO-2's.
    # ep replicates every weight but the experts', as dp does: ZeRO splits over it too.
    (1, ("fsdp", "sp"), ("fsdp", "sp", "dp", "ep"), ("fsdp", "sp", "dp", "ep")),
    (2, ("fsdp", "sp"), ("fsdp", "sp", "dp", "ep"), ("fsdp", "sp", "dp", "ep")),
    (3, ("fsdp", "sp", "dp", "ep"), ("fsdp", "sp", "dp", "ep"), ("fsdp", "sp", "dp", "ep")),
])
def test_zero_stage_selects_what_dp_splits(zero, params, grads, opt):
    rules = make_rules(zero)
    names = ("embed", "mlp")
    assert spec_for(names, rules.params) == jax.P(params, "tp")
    assert spec_for(names, rules.grads) == jax.P(grads, "tp")
    assert spec_for(names, rules.opt_state) == jax.P(opt, "tp")
    # An expert's weight names ep on its experts; ZeRO's ep is dropped from its embed.
    expert = ("experts", "embed", "mlp")
    assert spec_for(expert, rules.opt_state) == jax.P("ep", tuple(a for a in opt if a != "ep"), "tp")
    assert dict(rules.activation_rules())["batch"] == ("dp", "fsdp", "ep")
    # Accumulation stores embed sp major (spmd.parallel.rules.ACCUMULATED_EMBED), each ZeRO axis after.
    accumulating = make_rules(zero, accumulating=True)
    assert spec_for(names, accumulating.grads) == jax.P(("sp", "fsdp", *grads[2:]), "tp")


def test_scale_lr_applies_the_linear_scaling_rule():
    from spmd.parallel.optim import learning_rate

    assert learning_rate(parse_args(["--lr", "0.001", "--batch", "512", "--scale-lr"])) == 0.001 * 512 / 256
    assert learning_rate(parse_args(["--lr", "0.001", "--batch", "512"])) == 0.001
