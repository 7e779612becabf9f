"""Sharded, asynchronous checkpoints with Orbax, and resuming from them on any mesh.

A checkpoint is a directory `<run>/<step>/` with three items: `params`, `opt_state` (each
array saved as its shards, by the processes that hold them) and `meta` (JSON: the step,
the run's config, the model's shapes, one checksum per array). With step-indexed data the
step is all the data source needs. Orbax writes each checkpoint under a temporary name and
renames it when complete, so a crash or `kill -9` mid-save leaves the previous checkpoint
as the latest.

Restoring always goes through the target's abstract state: arrays are read straight into
the shardings of the current mesh, whatever mesh wrote them, then checked against their
checksums (spmd.formats.checksum: the same on every mesh). A checkpoint that cannot be read or
does not match is refused, naming the previous complete checkpoint to resume from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import traverse_util

from models.lora import ATTENTION_TARGETS
from spmd.base.cli import flag_of
from spmd.base.errors import UserError
from spmd.formats.checksum import checksums
from spmd.parallel.pipeline import REPEATED_SCHEDULES
from spmd.parallel.skeleton import STACKED_KEYS, is_stacked, restack

FORMAT = 1
# The state's arrays ("routing": the MoE layers' router state, kept by runs that balance
# experts, spmd.parallel.balance), and the JSON record.
ARRAY_ITEMS = ("params", "opt_state", "routing")
ITEMS = (*ARRAY_ITEMS, "meta")


def _shapes_of(params) -> dict[str, list[int]]:
    flat = traverse_util.flatten_dict(params)
    return {"/".join(map(str, path)): list(leaf.shape) for path, leaf in flat.items()}


def stacked_repeats(config: dict) -> int:
    """How a run's config stores the stacked layers: (layers, ...) or, under a circular
    pipeline, (repeats, layers / repeats, ...) (spmd.parallel.skeleton.restack)."""
    if config.get("pp_schedule") == "zb-v":
        return 2  # two chunks per stage, stored as circular's
    return config.get("pp_repeats", 1) if config.get("pp_schedule") in REPEATED_SCHEDULES else 1


def _model_shapes(shapes: dict[str, list[int]], repeats: int) -> dict[str, list[int]]:
    """Parameter shapes as the model has them, whatever the pipeline's storage."""
    if repeats == 1:
        return shapes
    return {k: [v[0] * v[1], *v[2:]] if k.split("/")[0] in STACKED_KEYS else v for k, v in shapes.items()}


def make_meta(options: dict, model: str, step: int, params) -> dict:
    """The record of a checkpoint of `params` (the trained ones: a LoRA run's adapters,
    whose frozen base the options name: its --init-from, or its --seed's initialization).
    `options`: the run's, by flat name (spmd.run.options.TrainConfig.record); `model`: its name."""
    return {"format": FORMAT, "step": step, "model": model, "config": options, "param_shapes": _shapes_of(params)}


class Checkpoints:
    """The checkpoints of one run directory."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=async_save),
            item_names=ITEMS,
        )

    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: dict, meta: dict) -> None:
        """Start saving; returns once the arrays are copied off the devices (safe to donate).
        The arrays' checksums go into `meta`, computed first (the next step donates them)."""
        arrays = [name for name in ARRAY_ITEMS if name in state]
        meta = {**meta, "checksums": checksums({name: state[name] for name in arrays})}
        self._manager.save(step, args=ocp.args.Composite(
            **{name: ocp.args.StandardSave(state[name]) for name in arrays}, meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def delete(self, step: int) -> None:
        self._manager.delete(step)

    def meta(self, step: int) -> dict:
        return read_meta(self.directory, step)

    def restore(self, step: int, abstract_state: dict, items=None, repeats: int = 1) -> dict:
        """Read `items` (default: the arrays of `abstract_state` a checkpoint holds: not the
        step, which is the checkpoint's, nor a LoRA run's frozen base) of checkpoint `step`
        into the shardings of `abstract_state`, whose stacked layers are stored for `repeats`
        (spmd.parallel.skeleton.restack). A checkpoint whose layers are stored otherwise is
        read as it was saved, checked, then restacked once."""
        meta = self.meta(step)
        items = items or tuple(name for name in abstract_state if name in ARRAY_ITEMS)
        saved = stacked_repeats(meta.get("config", {}))
        targets = {name: abstract_state[name] for name in items}
        as_saved = targets if saved == repeats else _as_saved(targets, repeats, saved)
        args = {name: ocp.args.StandardRestore(as_saved[name]) for name in items}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's bad input
            raise _unreadable(self.directory, step, exc) from None
        state = {name: restored[name] for name in items}
        _verify(self.directory, step, state, meta.get("checksums"))
        if saved != repeats:
            def convert(tree):
                tree = restack(tree, -1) if saved > 1 else tree
                return restack(tree, repeats) if repeats > 1 else tree
            state = jax.jit(convert, out_shardings=jax.tree.map(lambda t: t.sharding, targets))(state)
        if "step" in abstract_state:
            state["step"] = jax.device_put(jnp.asarray(step, jnp.int32), abstract_state["step"].sharding)
        return state

    def close(self) -> None:
        self._manager.close()


def finalized_steps(run_dir: Path) -> list[int]:
    """Steps whose checkpoints are complete (Orbax renames a checkpoint to its step when done)."""
    if not run_dir.is_dir():
        return []
    return sorted(int(p.name) for p in run_dir.iterdir() if p.is_dir() and p.name.isdigit())


def read_meta(run_dir: Path, step: int) -> dict:
    """The JSON `meta` item, read without Orbax (so before JAX starts its backend)."""
    try:
        meta = _load_meta(run_dir, step)
    except (OSError, ValueError) as exc:
        raise _unreadable(Path(run_dir), step, exc) from None
    if not _is_ours(meta):
        raise UserError(f"{Path(run_dir) / str(step)} is not an spmd checkpoint")
    return meta


def saved_config(path: str | Path) -> dict:
    """The run's config saved with the checkpoint `path` names (a run directory: its latest)."""
    run_dir, step = locate(path)
    if step is None:
        steps = finalized_steps(run_dir)
        if not steps:
            raise UserError(f"no spmd checkpoint in {run_dir}")
        step = steps[-1]
    return read_meta(run_dir, step).get("config", {})


def model_of_checkpoint(resume: str) -> tuple[str | None, dict | None]:
    """The model (preset name, or saved architecture) of the checkpoint `--resume` names."""
    config = saved_config(resume)
    return config.get("model"), config.get("architecture")


def _load_meta(run_dir: Path, step: int):
    return json.loads((Path(run_dir) / str(step) / "meta" / "metadata").read_text())


def _is_ours(meta) -> bool:
    return isinstance(meta, dict) and meta.get("format") == FORMAT


def _unreadable(run_dir: Path, step: int, exc: BaseException) -> UserError:
    # The first exception of the chain says what failed (Orbax's wrapper prints a TensorStore spec).
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        exc = inner
        seen.add(id(exc))
    text = str(exc).strip().splitlines()
    why = f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__
    return UserError(f"checkpoint {run_dir / str(step)} is unreadable ({why}); {_previous_complete(run_dir, step)}")


def _verify(run_dir: Path, step: int, state: dict, saved: dict | None) -> None:
    """The restored items (as they were saved) against the checksums saved with them;
    checkpoints written before checksums were kept are read unchecked."""
    if not saved:
        return
    got = checksums(state)
    bad = [f"{name}/{key}" for name in state for key, value in saved.get(name, {}).items()
           if got[name].get(key) != value]
    if bad:
        what = f"{bad[0]} does not match its checksum" if len(bad) == 1 else \
            f"{bad[0]} and {len(bad) - 1} more arrays do not match their checksums"
        raise UserError(f"checkpoint {run_dir / str(step)} is damaged: {what}; {_previous_complete(run_dir, step)}")


def _previous_complete(run_dir: Path, step: int) -> str:
    """Where to resume instead of a bad checkpoint: the newest finalized one before it
    whose meta reads (its arrays are checked when it is restored)."""
    for earlier in reversed([s for s in finalized_steps(run_dir) if s < step]):
        try:
            if _is_ours(_load_meta(run_dir, earlier)):
                where = run_dir / str(earlier)
                return f"the previous complete checkpoint is {where} (--resume {where})"
        except (OSError, ValueError):
            continue
    return "there is no earlier checkpoint"


def locate(path: str | Path) -> tuple[Path, int | None]:
    """`--resume PATH`: a run directory (its latest checkpoint) or one step's directory."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"--resume path does not exist: {path}")
    if path.name.isdigit() and (path / "meta").exists():
        return path.parent, int(path.name)
    return path, None


def _as_saved(targets, repeats: int, saved: int):
    """The abstract arrays of `targets` (stacked layers stored for `repeats`) as a
    checkpoint that stored them for `saved` repeats holds them, on the targets' mesh
    (the layers split over pp where they divide, the other dimensions as targeted)."""
    def leaf(path, target):
        if not is_stacked(path):
            return target
        stacked_dims = 2 if repeats > 1 else 1
        layers = math.prod(target.shape[:stacked_dims])
        spec = tuple(target.sharding.spec) + (None,) * target.ndim
        rest, rest_spec = target.shape[stacked_dims:], spec[stacked_dims:target.ndim]
        pp = target.sharding.mesh.shape["pp"]
        per_repeat = layers // saved
        stacked = ((saved, per_repeat), (None, "pp" if per_repeat % pp == 0 else None)) if saved > 1 else \
            ((layers,), ("pp" if layers % pp == 0 else None,))
        sharding = jax.NamedSharding(target.sharding.mesh, jax.P(*stacked[1], *rest_spec))
        return jax.ShapeDtypeStruct((*stacked[0], *rest), target.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(leaf, targets)


def check_compatible(meta: dict, options: dict, model: str, params_shapes, where: Path) -> None:
    """The checkpoint must hold the parameters this run builds, with the same shapes
    (as the model has them: a pipeline may store its stacked layers otherwise). `options`
    and `model`: this run's, as make_meta takes them."""
    saved = meta.get("config", {})
    want = _model_shapes(_shapes_of(params_shapes), stacked_repeats(options))
    have_shapes = _model_shapes(meta.get("param_shapes", {}), stacked_repeats(saved))
    saved_rank = saved.get("lora_rank") or None
    if saved_rank != options["lora_rank"]:
        trained = f"with --lora-rank {saved_rank}" if saved_rank else "as a full fine-tune"
        ours = f"--lora-rank {options['lora_rank']}" if options["lora_rank"] else "no --lora-rank"
        targets = saved.get("lora_targets") or SHAPING["lora_targets"][1]
        raise UserError(f"checkpoint {where} was trained {trained}; this run has {ours}: give "
                        + (f"--lora-rank {saved_rank} --lora-targets {targets}" if saved_rank else "no --lora-rank"))
    if have_shapes != want:
        _check_shaping_options(saved, options, where)
        have = meta.get("model", "?")
        differ = sorted(set(want) ^ set(meta.get("param_shapes", {}))) or [
            k for k in want if meta["param_shapes"].get(k) != want[k]]
        raise UserError(f"checkpoint {where} holds model {have!r} whose parameters differ from "
                        f"this run's {model!r} (first difference: {differ[0]})")
    if has_bias(saved) and not has_bias(options):
        raise UserError(f"checkpoint {where} was trained with --router-bias-rate, whose selection bias this run "
                        "would drop; give it --router-bias-rate too")


# The options besides the model that shape the parameters, each with what differs when its
# value does, and its value in a run that did not give it (a record older than the option).
SHAPING = {"redundant_experts": ("whose expert slots differ", 0),  # experts + R slots hold the experts
           "lora_targets": ("whose adapters are on other projections", ",".join(ATTENTION_TARGETS)),
           "empty_layers": ("whose stacked layers differ", 0),
           "mtp_depth": ("whose multi-token prediction modules differ", 0)}


def _check_shaping_options(saved: dict, ours: dict, where: Path) -> None:
    """Name the option whose value makes this run's parameters differ from the checkpoint's,
    with both values (`saved`, `ours`: the two runs' configs)."""
    for name, (why, default) in SHAPING.items():
        theirs, mine = saved.get(name) or default, ours[name] or default
        if _shaping_value(name, theirs) != _shaping_value(name, mine):
            raise UserError(f"checkpoint {where} was trained with {flag_of(name)} {theirs}; this run has "
                            f"{flag_of(name)} {mine}, {why}: give {flag_of(name)} {theirs}")


def _shaping_value(name: str, value):
    """A value as the parameters see it: LoRA's targets in any order."""
    return frozenset(t.strip() for t in value.split(",")) if name == "lora_targets" else value


def keeps_router(config: dict) -> bool:
    """Whether a run's MoE layers keep a router state (spmd.parallel.balance)."""
    return bool(config.get("router_bias_rate") or config.get("redundant_experts"))


def has_bias(config: dict) -> bool:
    """Whether a run's (or a served model's) router chooses experts with a learned bias."""
    return bool(config.get("router_bias_rate") or config.get("router_bias_weight"))


# What a resumed run must share with the run that wrote its checkpoint: the data order
# (batch, seq, seed) and the learning-rate schedule (steps, lr, warmup, ...). The layout,
# dtype, accumulation, ZeRO stage, remat, logging and saving may change.
RESUME_FIXED = ("steps", "batch", "seq", "seed", "lr", "warmup", "min_lr_ratio", "scale_lr", "ref_batch")


def check_resumable(meta: dict, options: dict, where: Path) -> None:
    """Refuse to resume a run whose data order or schedule this run (its `options`, as
    make_meta takes them) changes, unless --resume-with-changes."""
    if options["resume_with_changes"]:
        return
    old, new = meta.get("config", {}), options
    changed = [name for name in RESUME_FIXED if name in old and old[name] != new[name]]
    if "ref_batch" in changed and not (old.get("scale_lr") or new["scale_lr"]):
        changed.remove("ref_batch")  # only --scale-lr reads it
    if changed:
        raise UserError(f"checkpoint {where} was written by a run with {_flags(old, changed)}; this run has "
                        f"{_flags(new, changed)}; pass --resume-with-changes to continue with the new values")


def _flags(config: dict, names: list[str]) -> str:
    def flag(name):
        value = config[name]
        if isinstance(value, bool):
            return flag_of(name) if value else flag_of(f"no_{name}")
        return f"{flag_of(name)} {value}"
    return " ".join(map(flag, names))


def export_params(directory: str | Path, params, meta: dict) -> None:
    """Write parameters only (plus the model's description) to a fresh directory."""
    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", params)
        checkpointer.wait_until_finished()
    (directory / "model.json").write_text(json.dumps(
        {"model": meta["model"], "step": meta["step"], "param_shapes": meta["param_shapes"]}, indent=1))
