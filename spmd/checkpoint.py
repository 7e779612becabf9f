"""Sharded, asynchronous checkpoints with Orbax, and resuming from them on any mesh.

A checkpoint is a directory `<run>/<step>/` with three items: `params`, `opt_state` (each
array saved as its shards, by the processes that hold them) and `meta` (JSON: the step,
the run's config, the model's shapes). With step-indexed data the step is all the data
source needs. Orbax writes each checkpoint under a temporary name and renames it when
complete, so a crash or `kill -9` mid-save leaves the previous checkpoint as the latest.

Restoring always goes through the target's abstract state: arrays are read straight into
the shardings of the current mesh, whatever mesh wrote them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import traverse_util

from spmd.errors import UserError
from spmd.layout import is_stacked, restack

FORMAT = 1
ITEMS = ("params", "opt_state", "meta")


def _shapes_of(params) -> dict[str, list[int]]:
    flat = traverse_util.flatten_dict(params)
    return {"/".join(map(str, path)): list(leaf.shape) for path, leaf in flat.items()}


def stacked_repeats(config: dict) -> int:
    """How a run's config stores the stacked layers: (layers, ...) or, under a circular
    pipeline, (repeats, layers / repeats, ...) (spmd.layout.restack)."""
    return config.get("pp_repeats", 1) if config.get("pp_schedule") == "circular" else 1


def _model_shapes(shapes: dict[str, list[int]], repeats: int) -> dict[str, list[int]]:
    """Parameter shapes as the model has them, whatever the pipeline's storage."""
    if repeats == 1:
        return shapes
    return {k: [v[0] * v[1], *v[2:]] if k.startswith("blocks/") else v for k, v in shapes.items()}


def make_meta(cfg, step: int, params) -> dict:
    return {"format": FORMAT, "step": step, "model": cfg.model, "config": dataclasses.asdict(cfg),
            "param_shapes": _shapes_of(params)}


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
        """Start saving; returns once the arrays are copied off the devices (safe to donate)."""
        self._manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(state["params"]),
            opt_state=ocp.args.StandardSave(state["opt_state"]),
            meta=ocp.args.JsonSave(meta),
        ))

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def meta(self, step: int) -> dict:
        return read_meta(self.directory, step)

    def restore(self, step: int, abstract_state: dict, items=("params", "opt_state"), repeats: int = 1) -> dict:
        """Read `items` of checkpoint `step` into the shardings of `abstract_state`, whose
        stacked layers are stored for `repeats` (spmd.layout.restack). A checkpoint whose
        layers are stored otherwise is read as it was saved, then restacked once."""
        saved = stacked_repeats(self.meta(step).get("config", {}))
        targets = {name: abstract_state[name] for name in items}
        as_saved = targets if saved == repeats else _as_saved(targets, repeats, saved)
        args = {name: ocp.args.StandardRestore(as_saved[name]) for name in items}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's bad input
            raise _unreadable(self.directory / str(step), exc) from None
        state = {name: restored[name] for name in items}
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
    path = Path(run_dir) / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise _unreadable(path.parent.parent, exc) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{path.parent.parent} is not an spmd checkpoint")
    return meta


def _unreadable(where: Path, exc: Exception) -> UserError:
    text = str(exc).strip().splitlines()
    why = f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
    return UserError(f"checkpoint {where} is unreadable ({why})")


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


def check_compatible(meta: dict, cfg, params_shapes, where: Path) -> None:
    """The checkpoint must hold the parameters this run builds, with the same shapes
    (as the model has them: a pipeline may store its stacked layers otherwise)."""
    want = _model_shapes(_shapes_of(params_shapes), stacked_repeats(dataclasses.asdict(cfg)))
    have_shapes = _model_shapes(meta.get("param_shapes", {}), stacked_repeats(meta.get("config", {})))
    if have_shapes != want:
        have = meta.get("model", "?")
        differ = sorted(set(want) ^ set(meta.get("param_shapes", {}))) or [
            k for k in want if meta["param_shapes"].get(k) != want[k]]
        raise UserError(f"checkpoint {where} holds model {have!r} whose parameters differ from "
                        f"this run's {cfg.model!r} (first difference: {differ[0]})")


def is_empty_or_run_dir(path: Path) -> bool:
    """Whether `--out` may be written: missing, empty, or holding checkpoints of ours."""
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    return all(p.is_dir() and (p.name.isdigit() or ".orbax-checkpoint-tmp" in p.name) for p in path.iterdir())


def export_params(directory: str | Path, params, meta: dict) -> None:
    """Write parameters only (plus the model's description) to a fresh directory."""
    directory = Path(directory).absolute()
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", params)
        checkpointer.wait_until_finished()
    (directory / "model.json").write_text(json.dumps(
        {"model": meta["model"], "step": meta["step"], "param_shapes": meta["param_shapes"]}, indent=1))
