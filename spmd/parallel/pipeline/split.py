"""The split of a chunk's backward pass into its input-gradient (B) and weight-gradient (W)
parts, which zb-v and DualPipe need (spmd.parallel.pipeline.zero_bubble).

The backward pass of a chunk, traced to a jaxpr, is split by JAX's partial evaluation
with the forward residuals that only the weight gradients read (the matmuls' inputs)
marked unknown: what depends on them (the dW matmuls, inside the layer scan too) is
staged into W, and W receives from B the values of the chain it needs (each matmul
output's cotangent). Nothing is computed twice: B's and W's dot FLOPs add up to the
unsplit backward's.
"""

from __future__ import annotations

import jax
# JAX's own partial evaluation and DCE of jaxprs (with their rules for scan, remat, cond,
# shard_map) are internal API: a JAX upgrade may move them.
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from spmd.parallel.pipeline.kit import split_vjp


class SplitError(ValueError):
    pass


def split_backward(stage_fn, chunk, example, side_example=None, fixed=None):
    """A chunk's forward pass and its backward pass in two parts (`fixed`: weights not
    differentiated, as for spmd.parallel.pipeline._split_vjp):
    forward(chunk, x, side, fixed) -> ((y, statistics), b_residuals, w_residuals);
    backward_input(chunk, b_residuals, cotangents, fixed) -> (d_weights, dx, bw_residuals), where
    d_weights has the gradients of the weights that B computes anyway (vectors such as
    norm scales, whose gradients read only what the chain reads) and None elsewhere;
    backward_weight(bw_residuals, w_residuals) -> the other weights' gradients (None for
    B's). Also returns the shapes of the three residual lists."""
    forward, backward, res_shapes = split_vjp(stage_fn, chunk, example, side_example, fixed)
    weights, weights_tree = jax.tree.flatten((chunk, fixed))
    ct_shapes = jax.eval_shape(stage_fn, chunk, example, side_example, fixed)
    # nw gradients (of the chunk's weights) out; nk weights (the fixed ones too) in.
    nw, nk, nr = len(jax.tree.leaves(chunk)), len(weights), len(res_shapes)

    def flat_backward(*args):
        w, r, c = args[:nk], args[nk:nk + nr], args[nk + nr:]
        chunk, fixed = jax.tree.unflatten(weights_tree, w)
        d_chunk, dx = backward(chunk, list(r), jax.tree.unflatten(jax.tree.structure(ct_shapes), c), fixed)
        return [*jax.tree.leaves(d_chunk), dx]

    shapes = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in weights] + list(res_shapes) + [
        jax.ShapeDtypeStruct(s.shape, s.dtype) for s in jax.tree.leaves(ct_shapes)]
    closed = jax.make_jaxpr(flat_backward)(*shapes)
    jaxpr = pe.convert_constvars_jaxpr(closed.jaxpr)  # constants lead the inputs
    consts, nc = list(closed.consts), len(closed.consts)
    inputs = len(jaxpr.invars)
    # The forward residuals that the input gradient does not read: only W reads them.
    _, used_by_dx = pe.dce_jaxpr(jaxpr, [False] * nw + [True])
    unknown = [False] * inputs
    for i in range(nc + nk, nc + nk + nr):
        unknown[i] = not used_by_dx[i]
    if not any(unknown):
        raise SplitError("no forward residual is read by the weight gradients alone (a remat policy "
                         "recomputes the matmuls' inputs in the backward pass)")
    known, staged, out_unknown, out_inst, n_res = pe.partial_eval_jaxpr_custom(
        jaxpr, unknown, in_inst=unknown, ensure_out_unknowns=False, ensure_out_inst=False,
        saveable=lambda *_, **__: True)
    if out_unknown[-1]:
        raise SplitError("the input gradient depends on the weight-gradient part")
    # W: only the unknown outputs, from the residuals it reads. (The staged part may also
    # hold outputs B computes, e.g. a zero gradient: those are left to B.)
    assert all(inst for unk, inst in zip(out_unknown, out_inst) if unk)
    staged, staged_used = pe.dce_jaxpr(staged, [unk for unk, inst in zip(out_unknown, out_inst) if inst])
    res_used = staged_used[:n_res]
    w_inputs = [i for i in range(inputs) if unknown[i]]
    w_inputs = [i for i, used in zip(w_inputs, staged_used[n_res:]) if used]
    n_known_out = out_unknown.count(False)
    known, known_used = pe.dce_jaxpr(known, [True] * n_known_out + list(res_used))
    b_inputs = [i for i in range(inputs) if not unknown[i]]
    b_inputs = [i for i, used in zip(b_inputs, known_used) if used]
    b_res = [i - nc - nk for i in b_inputs if nc + nk <= i < nc + nk + nr]
    w_res = [i - nc - nk for i in w_inputs]
    assert all(nc + nk <= i < nc + nk + nr for i in w_inputs), "W reads only forward residuals"
    bw_shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in known.outvars[n_known_out:]]

    def forward_split(chunk, x, side=None, fixed=None):
        out, residuals = forward(chunk, x, side, fixed)
        return out, [residuals[i] for i in b_res], [residuals[i] for i in w_res]

    def backward_input(chunk, b_residuals, cotangents, fixed=None):
        args = consts + jax.tree.leaves((chunk, fixed)) + [None] * nr + jax.tree.leaves(cotangents)
        for i, r in zip(b_res, b_residuals):
            args[nc + nk + i] = r
        outs = core.eval_jaxpr(known, (), *[args[i] for i in b_inputs])
        known_outs, bw = iter(outs[:n_known_out]), outs[n_known_out:]
        grads = [None if unk else next(known_outs) for unk in out_unknown]
        return grads[:nw], grads[nw], bw

    def backward_weight(bw_residuals, w_residuals):
        outs = iter(core.eval_jaxpr(staged, (), *bw_residuals, *w_residuals))
        return [next(outs) if unk else None for unk in out_unknown[:nw]]

    return (forward_split, backward_input, backward_weight,
            ([res_shapes[i] for i in b_res], [res_shapes[i] for i in w_res], bw_shapes))


def whole_backward(stage_fn, chunk, example, side_example=None, fixed=None):
    """`split_backward`'s functions for a backward pass that is not split: B computes
    every weight's gradient, W nothing (no W residuals)."""
    forward, backward, res_shapes = split_vjp(stage_fn, chunk, example, side_example, fixed)

    def forward_split(chunk, x, side=None, fixed=None):
        out, residuals = forward(chunk, x, side, fixed)
        return out, residuals, []

    def backward_input(chunk, residuals, cotangents, fixed=None):
        d_chunk, dx = backward(chunk, residuals, cotangents, fixed)
        return jax.tree.leaves(d_chunk), dx, []

    return forward_split, backward_input, None, (list(res_shapes), [], [])
