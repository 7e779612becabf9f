"""What the compiled step sends over the wire."""

import math

import jax
import pytest
from support.parity import train_run

from spmd.planner import hlo, traffic

pytestmark = pytest.mark.floor  # the plan's reading of the HLO that each JAX version writes


def _param_bytes(run) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(run.params))


def test_grad_accumulation_reduces_gradients_once_per_step():
    accumulated = hlo.parse(train_run("dp=2,fsdp=4", 8, grad_accum=4).hlo)
    plain = hlo.parse(train_run("dp=2,fsdp=4", 8).hlo)
    param_bytes = _param_bytes(train_run("dp=2,fsdp=4", 8))

    # Without accumulation the backward layer loop reduces each layer's gradients, so the
    # check below can see reductions inside loops when they are there.
    assert plain.collectives_where(hlo.REDUCTIONS, inside_loops=True)

    # With 4 microbatches: the microbatch scan and the layer scans inside it hold no
    # reduction at all; after the scan, one gradient's worth of bytes is reduced once
    # (plus the scalar loss), not four.
    assert len(accumulated.loop_bodies) >= 2
    assert accumulated.collectives_where(hlo.REDUCTIONS, inside_loops=True) == []
    reduced = sum(c.result_bytes for c in accumulated.collectives_where(hlo.REDUCTIONS, inside_loops=False))
    assert param_bytes <= reduced < param_bytes + 1024


@pytest.mark.parametrize("mesh,devices,model,inner", [("dp=2,sp=2", 4, "tiny", {"sp"}),
                                                      ("dp=2,ep=2", 4, "moe-tiny", {"ep"})])
@pytest.mark.slow  # another layout of what the gate's parity tests hold once
def test_grad_accumulation_with_sp_or_split_experts_reduces_over_dp_once_per_step(mesh, devices, model, inner):
    """sp (and ep, where it splits the experts) work inside the accumulation's per-shard
    vmap, so their reductions run in every microbatch; dp's still runs once, after it."""
    run = train_run(mesh, devices, model=model, grad_accum=2)
    module = hlo.parse(run.hlo)
    in_loops = {_axes(run, c) for c in module.collectives_where(hlo.REDUCTIONS, inside_loops=True)}
    assert in_loops == inner
    once = [c for c in module.collectives_where(hlo.REDUCTIONS, inside_loops=False) if "dp" in _axes(run, c)]
    # After the scan, one gradient's worth of bytes per device (the experts: this device's
    # share) is reduced over dp, plus scalars.
    local = sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
                for s in jax.tree.leaves(run.program.abstract_state["params"]))
    assert local <= sum(c.result_bytes for c in once) < local + 1024


def _axes(run, collective) -> str:
    groups = traffic.device_groups(collective.attributes, run.layout.mesh.devices.size)
    return traffic.axes_of_groups(groups, {a: n for a, n in run.layout.shape.items() if n > 1})


def test_pure_data_parallel_never_gathers_parameters():
    # Under DP (ZeRO-0) parameters are replicated: the only collectives are reductions.
    module = hlo.parse(train_run("dp=8", 8).hlo)
    assert {c.op for c in module.collectives} == {"all-reduce"}


def test_fsdp_gathers_parameters_and_stores_them_sharded():
    run = train_run("fsdp=8", 8)
    module = hlo.parse(run.hlo)
    assert module.collectives_where(("all-gather",))
    wq = run.layout.shardings(run.layout.rules.params)["blocks"]["attn"]["wq"]
    # (layers, embed, heads, head_dim): embed split 8 ways at rest.
    assert wq.shard_shape((2, 64, 8, 8)) == (2, 8, 8, 8)


def test_the_embedding_table_stays_where_it_is_stored():
    """Under fsdp the lookup sends the tokens' ids to the table's shards and gets their
    rows back (an all-to-all), and the rows' gradients go the same way: no collective
    holds the table (vocab 256 x embed 64) whole. Gathered for the lookup, its gradient
    was summed whole before each device kept its slice, which XLA:GPU ran as an all-reduce
    of the float32 table over fsdp+ep (2.2 GiB a step on Qwen3-30B-A3B's preset)."""
    run = train_run("fsdp=8", 8)
    module = hlo.parse(run.hlo)
    whole = [c.line for c in module.collectives if "[256,64]" in module.instructions[c.computation][c.name].result_type]
    # (The head's gradient, (embed, vocab), is reduced as XLA lays it out: (vocab, embed).)
    assert [line for line in whole if "bse,ev->bsv" not in line] == []
    assert {traffic.axes_of_groups(traffic.device_groups(c.attributes, 8), run.layout.shape)
            for c in module.collectives_where(("all-to-all",))} == {"fsdp"}


def test_replica_groups_over_part_of_an_axis_are_read():
    """Newer XLA (jax 0.12) writes groups over part of an axis as a sub-axis: `'tp':(4)2`
    is the 2 devices after the first 4 of tp's 8, major to minor (neighbours), `'tp':(1)4`
    every second one."""
    mesh = "replica_groups=mesh['fsdp'=2,'tp'=8] {'tp':(%s)%s}"
    assert traffic.device_groups(mesh % (4, 2), 16) == [[2 * i, 2 * i + 1] for i in range(8)]
    assert traffic.device_groups(mesh % (1, 4), 16) == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    shape = {"fsdp": 2, "tp": 8}
    assert traffic.axes_of_groups(traffic.device_groups(mesh % (4, 2), 16), shape) == "tp:inner2"
    assert traffic.axes_of_groups(traffic.device_groups(mesh % (1, 4), 16), shape) == "tp:outer4"


def test_branches_that_say_how_often_they_run_are_weighed_so():
    """A loop of 4 trips whose switch takes branch 0 three times and branch 1 once
    (`counted_switch`, as the split-backward pipelines' pairs of ticks): branch 0's matmul
    and all-reduce count 3 times a step, branch 1's once, where a branch that said
    nothing would count every trip (or, in the FLOPs, not at all). A conditional nested
    in a counted branch has the outer scope in its names but says nothing itself: its
    branches stay out of the loops' FLOPs."""
    import jax.numpy as jnp
    import numpy as np

    from spmd.parallel.pipeline.kit import counted_switch

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    a, b = np.ones((8, 8), np.float32), np.ones((8, 16), np.float32)

    def often(x, t):
        return jax.lax.psum(x @ a, "x")

    def once(x, t):
        y = (x @ b) @ b.T
        return jax.lax.cond(t > 100, lambda y: y @ a, lambda y: y, y)

    def step(x):
        body = counted_switch([0, 0, 0, 1], [often, once])
        return jax.lax.scan(lambda c, s: (body(c, s), None), x, (jnp.arange(4), jnp.asarray([0, 0, 0, 1])))[0]

    mapped = jax.shard_map(step, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), check_vma=False)
    module = hlo.parse(jax.jit(mapped).lower(jnp.ones((4, 8), jnp.float32)).compile().as_text())
    matmul = 2 * 4 * 8 * 8
    assert hlo.loop_dot_flops(module) == 3 * matmul + 1 * 2 * 2 * 4 * 8 * 16
    runs = module.runs_per_step()
    [reduce] = module.collectives_where(("all-reduce",))
    assert runs[reduce.computation] == 3


def test_the_grouped_matmuls_pieces_count_as_under_even_routing():
    """GPUs run a ragged dot as a loop of t / rows + groups trips, one piece of a group's
    rows each; the trips past the rows skip their work. Under even routing (the theory's)
    one piece per group has rows: a piece's matmul and its sum over a split contraction
    (tp's, in the experts' down projection) count `groups` times a step, not every trip
    (the MoE + tp pair compiled for two H100s read 1.31 of the theory's all-reduces)."""
    import jax.numpy as jnp

    from models.ragged import by_pieces

    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    t, k, n, groups = 64, 16, 8, 4
    split = jax.NamedSharding(mesh, jax.P(None, "tp")), jax.NamedSharding(mesh, jax.P(None, "tp", None))
    product = jax.jit(lambda x, w, sizes: by_pieces(x, w, sizes, t // groups),
                      in_shardings=(*split, None), out_shardings=jax.NamedSharding(mesh, jax.P()))
    shapes = (jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((groups, k, n), jnp.float32),
              jax.ShapeDtypeStruct((groups,), jnp.int32))
    module = hlo.parse(product.lower(*shapes).compile().as_text())
    [reduce] = module.collectives_where(("all-reduce",))
    assert module.runs_per_step()[reduce.computation] == groups
    assert hlo.loop_dot_flops(module) == groups * 2 * (t // groups) * (k // 2) * n  # a piece a group, k split


def test_a_ragged_exchange_is_the_size_of_its_result():
    """XLA:GPU's asynchronous ragged all-to-all returns its operands with its result; the
    exchange is the result's (the dropless exchange back: 128 MiB of rows from a 1 GiB
    buffer, counted as 1 GiB until this was read)."""
    line = ("%start = ((bf16[262144,2048]{1,0}, bf16[32768,2048]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, "
            "/*index=5*/s64[8]{0}), bf16[32768,2048]{1,0}) ragged-all-to-all-start(%a, %b, %c, %d, %e, %f), "
            "replica_groups={{0,1}}")
    ops = "\n".join(f"  %{n} = {t} parameter({i})" for i, (n, t) in enumerate(
        [("a", "bf16[262144,2048]"), ("b", "bf16[32768,2048]")] + [(n, "s64[8]") for n in "cdef"]))
    module = hlo.parse(f"ENTRY %main {{\n{ops}\n  {line}\n  ROOT %done = bf16[32768,2048]{{1,0}} "
                       "ragged-all-to-all-done(%start)\n}\n")
    (exchange,) = module.collectives
    assert exchange.result_bytes == 32768 * 2048 * 2
    (row,) = traffic.step_traffic(module, {"ep": 2})
    assert row.bytes_per_device == 32768 * 2048 * 2 / 2  # the half that leaves, under even routing


@pytest.mark.parametrize("kept_by, scattered", [(("pp", "dp"), True), (("dp", "ep"), False)])
def test_a_sum_sliced_is_a_reduce_scatter_only_where_each_device_keeps_its_own_slice(kept_by, scattered):
    """An all-reduce over pp+dp whose result each device slices to a quarter: by its place
    in the group (pp, dp) it is a reduce-scatter; by dp and ep, as ZeRO-1 shards DualPipe's
    head gradient, both pp ranks of a group keep the same quarter, and XLA:GPU keeps the
    all-reduce. Read by shape alone, XLA:CPU's was counted a reduce-scatter (half the
    bytes, a row the theory did not expect)."""
    import jax.numpy as jnp

    mesh = jax.make_mesh((2, 2, 2), ("pp", "dp", "ep"), devices=jax.devices()[:8])

    def step(x):
        total = jax.lax.psum(x, ("pp", "dp"))
        quarter = 2 * jax.lax.axis_index(kept_by[0]) + jax.lax.axis_index(kept_by[1])
        return jax.lax.dynamic_slice_in_dim(total, quarter * 64, 64)

    mapped = jax.shard_map(step, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(("pp", "dp", "ep")))
    module = hlo.parse(jax.jit(mapped).lower(jnp.ones((256,), jnp.float32)).compile().as_text())
    rows = {(row.op, row.axes): row.bytes_per_device for row in traffic.step_traffic(
        module, {"pp": 2, "dp": 2, "ep": 2})}
    whole = 256 * 4
    assert rows == ({("reduce-scatter", "pp+dp"): 3 / 4 * whole} if scattered
                    else {("all-reduce", "pp+dp"): 2 * 3 / 4 * whole})


@pytest.mark.parametrize("kv_rows_by_device", [True, False])
def test_a_sum_read_in_pieces_is_a_reduce_scatter_where_every_piece_is_in_the_devices_part(kv_rows_by_device):
    """XLA:TPU reads a fused projection's summed gradient in two slices, the query heads'
    columns and the key/value heads', both from the rows of the device's own part (the
    rows' offset follows the device, the columns' is a constant). That is a reduce-scatter
    of the rows; counted by each slice's shape (one a sixth, one a twelfth), it read as a
    whole all-reduce (2.8 GiB a step "unexpected" on llama3-8b over fsdp=16). Where one
    piece is read at the same rows on every device, the sum is needed whole."""
    import jax.numpy as jnp

    mesh = jax.make_mesh((4,), ("fsdp",), devices=jax.devices()[:4])

    def step(x):
        total = jax.lax.psum(x, "fsdp")
        rows = jax.lax.axis_index("fsdp") * 4
        query = jax.lax.dynamic_slice(total, (rows, 0), (4, 4))
        key_value = jax.lax.dynamic_slice(total, (rows if kv_rows_by_device else 0, 4), (4, 2))
        return query * 2, key_value + 1

    mapped = jax.shard_map(step, mesh=mesh, in_specs=jax.P(), out_specs=(jax.P("fsdp"), jax.P("fsdp")))
    module = hlo.parse(jax.jit(mapped).lower(jnp.ones((16, 6), jnp.float32)).compile().as_text())
    rows = {(row.op, row.axes): row.bytes_per_device for row in traffic.step_traffic(module, {"fsdp": 4})}
    whole = 16 * 6 * 4
    assert rows == ({("reduce-scatter", "fsdp"): 3 / 4 * whole} if kv_rows_by_device
                    else {("all-reduce", "fsdp"): 2 * 3 / 4 * whole})


COMBINED = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%concatenated (a: f32[8], b: f32[1]) -> f32[9] {
  %a = f32[8] parameter(0)
  %b = f32[1] parameter(1)
  ROOT %c = f32[9] concatenate(%a, %b), dimensions={0}
}

%first (p: f32[9]) -> f32[8] {
  %p = f32[9] parameter(0)
  ROOT %s = f32[8] slice(%p), slice={[0:8]}
}

%last (q: f32[9]) -> f32[1] {
  %q = f32[9] parameter(0)
  ROOT %t = f32[1] slice(%q), slice={[8:9]}
}

ENTRY %main (g: f32[8], loss: f32[1]) -> (f32[2], f32[1]) {
  %g = f32[8] parameter(0)
  %loss = f32[1] parameter(1)
  %cat = f32[9] fusion(%g, %loss), kind=kLoop, calls=%concatenated
  %ar = f32[9] all-reduce(%cat), replica_groups={{0,1,2,3}}, to_apply=%add
  %scale = f32[8] fusion(%ar), kind=kLoop, calls=%first
  %total = f32[1] fusion(%ar), kind=kLoop, calls=%last
  %id = u32[] partition-id()
  %two = u32[] constant(2)
  %at = u32[] multiply(%id, %two)
  %mine = f32[2] dynamic-slice(%scale, {offset}), dynamic_slice_sizes={2}
  ROOT %out = (f32[2], f32[1]) tuple(%mine, %total)
}
"""


@pytest.mark.parametrize("offset, scattered", [("%at", True), ("%two", False)])
def test_sums_that_xla_combined_are_read_piece_by_piece(offset, scattered):
    """XLA:GPU's all-reduce combiner concatenates small sums (the final norm's scale
    gradient and the loss) into one all-reduce and slices them out after. Where each
    device then keeps its own part of the scale's sum, that piece is a reduce-scatter
    and the loss an all-reduce; read as one value, it was a whole all-reduce "unexpected"
    (30 KiB over dp+fsdp on llama2-7b-hsdp-16gpu, 34 KiB over fsdp+ep on mixtral)."""
    module = hlo.parse(COMBINED.replace("{offset}", offset))
    rows = {(row.op, row.axes): row.bytes_per_device for row in traffic.step_traffic(module, {"fsdp": 4})}
    assert rows == ({("reduce-scatter", "fsdp"): 3 / 4 * 8 * 4, ("all-reduce", "fsdp"): 2 * 3 / 4 * 4}
                    if scattered else {("all-reduce", "fsdp"): 2 * 3 / 4 * 9 * 4})
