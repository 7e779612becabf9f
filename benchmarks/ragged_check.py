"""Dropless experts with `jax.lax.ragged_all_to_all` (what GPUs and TPUs run) against the
padded all-to-all (what XLA:CPU runs), on the devices there are, ep = their count:
forward outputs and gradients, and the ragged all-to-alls of the compiled program; and the
experts' grouped matmul in pieces (what GPUs run) against jax.lax.ragged_dot.

    python benchmarks/ragged_check.py   # on a GPU or TPU: the op itself (one GPU: ep=1)
    JAX_PLATFORMS=cpu python benchmarks/ragged_check.py --devices 4   # the op's model (XLA:CPU lacks it)

Uneven loads: the router prefers low expert ids, so some devices receive many more rows
than others. Prints the largest differences; exit 1 when they exceed float32 rounding.
"""

import argparse
import functools
import os
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=0, help="CPU devices to emulate (0: the backend's own)")
    args = parser.parse_args()
    if args.devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np

    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from spmd.parallel import experts

    devices = jax.devices()
    ep = len(devices)
    mesh = jax.make_mesh((ep,), (experts.AXIS,), devices=devices)
    exchange = experts.ragged_exchange(mesh)
    name = "jax.lax.ragged_all_to_all"
    if exchange is None:
        exchange, name = experts.ragged_all_to_all_model, "its model (an all-to-all of padded blocks)"
    print(f"{ep} x {devices[0].platform} ({devices[0].device_kind}), ep={ep}, the ragged path with {name}")

    n_experts, k, embed, hidden, batch, seq = 2 * ep, 2, 64, 128, 4 * ep, 32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, seq, embed), np.float32)
    weights = 1.0 / np.arange(1, n_experts + 1)  # uneven: expert 0 is chosen most
    choice = np.stack([rng.choice(n_experts, k, replace=False, p=weights / weights.sum())
                       for _ in range(batch * seq)]).reshape(batch, seq, k).astype(np.int32)
    gate = rng.uniform(0.1, 1.0, (batch, seq, k)).astype(np.float32)
    gate_up = 0.1 * rng.standard_normal((n_experts, embed, 2, hidden), np.float32)
    down = 0.1 * rng.standard_normal((n_experts, hidden, embed), np.float32)
    loads = np.bincount(choice.reshape(-1) // (n_experts // ep), minlength=ep)
    print(f"rows per destination device: {loads.tolist()}")

    def layer(body):
        split = jax.P(experts.AXIS)
        mapped = jax.shard_map(lambda x, e, g, gu, d: body(x, e, None, g, gu, d), mesh=mesh,
                               in_specs=(split,) * 5, out_specs=split, check_vma=False)

        def loss(x, gate_up, down, choice, gate):
            out = mapped(x, choice, gate, gate_up, down)
            return jnp.sum(out * jnp.sin(out)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    ragged = layer(functools.partial(experts._dropless_ragged, ep=ep, ragged=exchange))
    padded = layer(functools.partial(experts._dropless, ep=ep, capacity=None))
    args_ = jax.device_put((x, gate_up, down, choice, gate), jax.NamedSharding(mesh, jax.P(experts.AXIS)))
    text = ragged.lower(*args_).compile().as_text()
    print(f"compiled: {text.count('ragged-all-to-all(')} ragged-all-to-all, "
          f"{text.count(' all-to-all(')} all-to-all instructions")
    (got_loss, got_out), got_grads = ragged(*args_)
    (want_loss, want_out), want_grads = padded(*args_)
    worst = 0.0
    for label, got, want in [("output", got_out, want_out), ("d x", got_grads[0], want_grads[0]),
                             ("d gate_up", got_grads[1], want_grads[1]), ("d down", got_grads[2], want_grads[2])]:
        got, want = np.asarray(got), np.asarray(want)
        diff = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) or 1.0))
        worst = max(worst, diff)
        print(f"{label:>10}: largest difference {diff:.2e} of the largest value")
    print(f"loss: ragged {float(got_loss):.6f}, padded {float(want_loss):.6f}")
    worst = max(worst, pieces_against_ragged_dot(x.reshape(-1, embed)[:200], gate_up.reshape(n_experts, embed, -1)))
    # Float32: the same products, summed in another order (rows arrive compacted, not padded).
    ok = worst < 1e-5
    print(f"ragged vs padded: {'equal to float32 rounding' if ok else 'DIFFERENT'} (worst {worst:.2e})")
    return 0 if ok else 1


def pieces_against_ragged_dot(rows, weights) -> float:
    """The experts' grouped matmul as GPUs run it (models.ragged.by_pieces, pieces of one
    expert's rows) against jax.lax.ragged_dot (XLA:GPU: a dense matmul over every expert),
    values and gradients, with an empty group and rows past the groups."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from models.ragged import by_pieces

    groups = weights.shape[0]
    sizes = np.full(groups, (rows.shape[0] - 7) // groups)
    sizes[1], sizes[0] = 0, sizes[0] + sizes[1]

    def both(product):
        f = lambda x, w: jnp.sum(jnp.sin(product(x, w)))  # noqa: E731
        return (product(rows, weights), *jax.jit(jax.grad(f, argnums=(0, 1)))(rows, weights))

    got = both(lambda x, w: by_pieces(x, w, jnp.asarray(sizes, jnp.int32), 16))
    want = both(lambda x, w: jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32)))
    worst = max(float(np.max(np.abs(np.asarray(g) - np.asarray(w))) / (np.max(np.abs(np.asarray(w))) or 1.0))
                for g, w in zip(got, want))
    print(f"grouped matmul in pieces vs jax.lax.ragged_dot: largest difference {worst:.2e} of the largest value")
    return worst


if __name__ == "__main__":
    sys.exit(main())
