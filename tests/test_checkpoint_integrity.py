"""Checkpoints detect damage (a checksum per array, the same on every mesh), a bad one is
refused naming the previous complete checkpoint, and a resume that would change the
run's data order or schedule is refused unless asked for.

How Orbax 0.12.8 stores an item (`<step>/params`, `<step>/opt_state`): one OCDBT
key-value store (`manifest.ocdbt`, b-tree nodes in `d/`, the values in
`ocdbt.process_<i>/d/<hash>` files, many chunks per file), whose keys are zarr v2 arrays
named by their dotted path (`blocks.mlp.down/.zarray`, chunks `blocks.mlp.down/1.0.0`),
each chunk zstd-compressed (level 1, frames without a content checksum). Bytes flipped
or cut in a data file land in compressed frames or b-tree nodes and mostly make the read
fail: the unreadable case, made here by truncating the files. A wrong value that still
reads (a bit flipped before compression, in memory or by a tool; or rot that zstd happens
to decode) is made by rewriting one element through TensorStore, which writes a
well-formed new chunk and manifest.
"""

import functools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import tensorstore as ts
from support.commands import losses_by_step, one_error_line, snapshot

from spmd.base.errors import UserError
from spmd.config import TrainConfig, validate
from spmd.formats.checkpoint import Checkpoints, check_resumable, read_meta
from spmd.formats.checksum import array_checksum, checksums
from spmd.layout import make_layout
from spmd.parallel.step import build_program

pytestmark = pytest.mark.xdist_group("integrity")  # the tests share one saved run

RUN = ["--batch", "8", "--seq", "32", "--steps", "4", "--log-every", "1"]  # default mesh dp=2,fsdp=2,tp=2
CONFIG = TrainConfig.of(batch=8, seq=32, steps=4, log_every=1)


def _train(*args) -> subprocess.CompletedProcess:
    # conftest's environment: unoptimized XLA, the session's shared compilation cache
    return subprocess.run([sys.executable, "-m", "spmd.train", *RUN, *args], capture_output=True, text=True,
                          timeout=300)



@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-step run on dp=2,fsdp=2,tp=2 with checkpoints 2 and 4, and its losses."""
    base = tmp_path_factory.mktemp("integrity")
    done = _train("--save-every", "2", "--out", str(base / "run"), "--metrics-file", str(base / "losses.jsonl"))
    assert done.returncode == 0, done.stderr
    return base / "run", losses_by_step(base / "losses.jsonl")


@pytest.fixture
def copy(saved, tmp_path):
    """A copy of the saved run, to damage."""
    return Path(shutil.copytree(saved[0], tmp_path / "run"))


def _refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    return one_error_line(done.stderr)


def _flip_a_bit(item: Path, array: str, index: tuple, bit: int) -> None:
    """Flip one bit of one float32 element of a saved array, leaving the files readable."""
    store = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{item}/"},
                     "path": f"{array}/"}).result()
    before = store[index].read().result()
    store[index].write((before.view(np.uint32) ^ np.uint32(1 << bit)).view(np.float32)).result()
    assert store[index].read().result() != before  # the damage is there, as a reader sees it


@functools.lru_cache(maxsize=None)
def _abstract_state(mesh: str, devices: int) -> dict:
    cfg = validate(CONFIG.replace(mesh=mesh))
    return build_program(cfg.step, make_layout(cfg, jax.devices()[:devices])).abstract_state


def _restore(run: Path, step: int, mesh="dp=2,fsdp=2,tp=2", devices=8, **kwargs) -> dict:
    checkpoints = Checkpoints(run)
    try:
        return checkpoints.restore(step, _abstract_state(mesh, devices), **kwargs)
    finally:
        checkpoints.close()


def _mix(h: np.ndarray) -> np.ndarray:
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _reference_checksum(host: np.ndarray) -> int:
    """spmd.formats.checksum's definition, on the host: sum of mix(bits ^ mix(flat index)) in uint32."""
    bits = host.view({2: np.uint16, 4: np.uint32}[host.itemsize]).astype(np.uint32).ravel()
    return int(np.sum(_mix(bits ^ _mix(np.arange(bits.size, dtype=np.uint32))), dtype=np.uint32))


def test_checksums_do_not_depend_on_the_sharding_and_see_one_bit():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    values = np.random.default_rng(0).standard_normal((4, 8, 6)).astype(np.float32)
    arrays = {
        "float32": values,
        "bfloat16": values.astype(jax.numpy.bfloat16),
        "int32": (values * 1000).astype(np.int32),
    }
    checksum = jax.jit(array_checksum)
    for name, host in arrays.items():
        want = _reference_checksum(host)
        for sharding in (jax.devices()[0], jax.NamedSharding(mesh, jax.P("a", "b", "c")),
                         jax.NamedSharding(mesh, jax.P(None, ("c", "a"), "b")), jax.NamedSharding(mesh, jax.P())):
            assert int(checksum(jax.device_put(host, sharding))) == want, (name, sharding)
        # One bit of one element, and two elements swapped, are each seen on a sharded array.
        bits = host.view(np.uint16 if host.itemsize == 2 else np.uint32).copy()
        bits[2, 3, 5] ^= 1
        swapped = host.copy()
        swapped[0, 0, 0], swapped[3, 7, 5] = host[3, 7, 5], host[0, 0, 0]
        for changed in (bits.view(host.dtype), swapped):
            assert int(checksum(jax.device_put(changed, jax.NamedSharding(mesh, jax.P("a", "b", "c"))))) != want, name
    # A scalar (optax's step count) has one too, and the keys are the tree's paths.
    tree = {"params": {"w": jax.numpy.ones((2, 2))}, "opt_state": ({"count": jax.numpy.int32(7)},)}
    assert checksums(tree) == {"params": {"w": _reference_checksum(np.ones((2, 2), np.float32))},
                               "opt_state": {"0/count": _reference_checksum(np.array(7, np.int32))}}


def test_every_array_has_its_checksum_and_another_mesh_verifies_them(saved):
    run, losses = saved
    meta = read_meta(run, 2)
    assert set(meta["checksums"]["params"]) == set(meta["param_shapes"])
    assert "1/0/count" in meta["checksums"]["opt_state"]  # adam's step count, and its moments:
    assert {k for k in meta["checksums"]["opt_state"] if "/mu/" in k} == {f"1/0/mu/{k}" for k in meta["param_shapes"]}
    # In-process, on one device: the arrays verify and equal those restored on the saving mesh.
    one = _restore(run, 4, mesh="dp=1", devices=1)
    eight = _restore(run, 4)
    for got, want in zip(jax.tree.leaves(jax.device_get(one)), jax.tree.leaves(jax.device_get(eight)), strict=True):
        np.testing.assert_array_equal(got, want)
    # From the command line, on 4 devices: verified, and the run goes on. Another mesh
    # sums in another order: within float32 rounding (1e-5 relative is the parity spec).
    done = _train("--mesh", "fsdp=4", "--resume", str(run / "2"), "--metrics-file", str(run.parent / "fsdp4.jsonl"))
    assert done.returncode == 0, done.stderr
    assert f"resumed from {run / '2'}" in done.stdout
    resumed = losses_by_step(run.parent / "fsdp4.jsonl")
    assert sorted(resumed) == [2, 3]
    np.testing.assert_allclose([resumed[s] for s in (2, 3)], [losses[s] for s in (2, 3)], rtol=1e-5, atol=0)


def test_a_changed_value_is_refused_naming_the_previous_checkpoint(saved, copy, tmp_path):
    _, losses = saved
    _flip_a_bit(copy / "4" / "params", "blocks.mlp.down", (1, 100, 33), bit=0)  # one ulp of one weight
    before = snapshot(copy)
    line = _refused(_train("--out", str(copy)))  # resumes the latest by itself
    assert line == (f"error: checkpoint {copy / '4'} is damaged: params/blocks/mlp/down does not match its "
                    f"checksum; the previous complete checkpoint is {copy / '2'} (--resume {copy / '2'})")
    assert snapshot(copy) == before  # nothing written
    # The one it names resumes and finishes, with the run's own numbers (same mesh: bit-identical),
    # writing on into the same directory: the damaged step 4 is replaced by a sound one.
    done = _train("--resume", str(copy / "2"), "--out", str(copy), "--metrics-file", str(tmp_path / "resumed.jsonl"))
    assert done.returncode == 0, done.stderr
    assert losses_by_step(tmp_path / "resumed.jsonl") == {2: losses[2], 3: losses[3]}
    assert f"the later checkpoints of {copy} (4) are replaced" in done.stdout
    assert _restore(copy, 4)["params"]  # verifies against its checksums


def test_an_unreadable_checkpoint_is_refused_naming_the_previous_checkpoint(copy):
    for chunk in (copy / "4" / "opt_state" / "ocdbt.process_0" / "d").iterdir():
        chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    before = snapshot(copy)
    line = _refused(_train("--out", str(copy)))
    assert line.startswith(f"error: checkpoint {copy / '4'} is unreadable (")
    assert f"{copy / '4' / 'opt_state'}" in line  # the reason names the item that does not read
    assert line.endswith(f"); the previous complete checkpoint is {copy / '2'} (--resume {copy / '2'})")
    assert snapshot(copy) == before


def test_restores_check_what_they_read_and_name_only_checkpoints_that_read(copy):
    _flip_a_bit(copy / "2" / "opt_state", "1.0.nu.head", (3, 7), bit=30)
    # Export reads the parameters only: those are intact.
    params = _restore(copy, 2, items=("params",))["params"]
    assert set(params) == {"blocks", "embedding", "final_norm", "head"}
    with pytest.raises(UserError) as error:
        _restore(copy, 2)
    assert str(error.value) == (f"checkpoint {copy / '2'} is damaged: opt_state/1/0/nu/head does not match its "
                                "checksum; there is no earlier checkpoint")
    # A checkpoint written before checksums were kept is read unchecked.
    meta_file = copy / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "checksums"}))
    _restore(copy, 2)
    # A meta that does not read: step 4's names step 2; once 2's is gone too, none.
    (copy / "4" / "meta" / "metadata").write_text("{")
    previous = re.escape(f"the previous complete checkpoint is {copy / '2'} (--resume {copy / '2'})")
    with pytest.raises(UserError, match=rf"is unreadable .*; {previous}$"):
        read_meta(copy, 4)
    meta_file.unlink()
    with pytest.raises(UserError, match="is unreadable .*; there is no earlier checkpoint$"):
        read_meta(copy, 4)


def test_a_changed_run_is_refused_unless_asked_for(saved, tmp_path):
    run, _ = saved
    line = _refused(_train("--resume", str(run / "2"), "--steps", "6"))
    assert line == (f"error: checkpoint {run / '2'} was written by a run with --steps 4; this run has --steps 6; "
                    "pass --resume-with-changes to continue with the new values")
    done = _train("--resume", str(run / "2"), "--steps", "6", "--resume-with-changes",
                  "--metrics-file", str(tmp_path / "longer.jsonl"))
    assert done.returncode == 0, done.stderr
    assert sorted(losses_by_step(tmp_path / "longer.jsonl")) == [2, 3, 4, 5]


def test_check_resumable_names_each_changed_option_and_lets_the_layout_change(saved):
    run, _ = saved
    meta, where = read_meta(run, 2), run / "2"
    # ref_batch too: it is read only with --scale-lr, which neither run has.
    same = CONFIG.replace(mesh="fsdp=4", dtype="bfloat16", grad_accum=2, zero=1, remat="full",
                          save_every=1, log_every=2, eval_every=2, ref_batch=64)
    check_resumable(meta, same.record(), where)
    changed = CONFIG.replace(batch=16, seed=3, lr=1e-3, warmup=5, min_lr_ratio=0.5, scale_lr=True,
                             seq=64)
    with pytest.raises(UserError) as error:
        check_resumable(meta, changed.record(), where)
    assert str(error.value) == (
        f"checkpoint {where} was written by a run with --batch 8 --seq 32 --seed 0 --lr 0.003 --warmup 20 "
        "--min-lr-ratio 0.1 --no-scale-lr; this run has --batch 16 --seq 64 --seed 3 --lr 0.001 --warmup 5 "
        "--min-lr-ratio 0.5 --scale-lr; pass --resume-with-changes to continue with the new values")
    check_resumable(meta, changed.replace(resume_with_changes=True).record(), where)
