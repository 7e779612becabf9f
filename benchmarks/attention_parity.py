"""Parity of attention kernels (models.attention.KERNELS): forward outputs and the gradients
of q, k and v on random inputs, each pair of the kernels named against each other, with each one's
error against a float32 reference (the xla kernel in float32) beside it; and the time of
one forward + backward pass of each, measured in this run.

    python benchmarks/attention_parity.py --kernels cudnn,chunked            # a GPU, bfloat16
    python benchmarks/attention_parity.py --kernels xla,chunked --seq 256    # the CPU

A pair passes when the relative difference (L2 norm of the difference over that of the
float32 reference) is at most --tol (default: 2e-2 in bfloat16, whose rounding step is
4e-3; 1e-5 in float32). A fused kernel that could not take the call and fell back to the
chunked one (models.attention.fallback) fails: its parity would prove nothing. Positions
are 0, 1, 2, ... given as constants, as the fused kernels need. Exit status 1 if any fails.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="cudnn,chunked", help="comma-separated; each pair that ran is compared")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="query heads per key/value head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tol", type=float, default=None)
    parser.add_argument("--repeats", type=int, default=5, help="timed forward + backward passes per kernel")
    parser.add_argument("--interpret", action="store_true", help="splash: run the Pallas kernel in its interpreter")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from models import attention
    from models.attention import Mask

    kernels = getattr(attention, "KERNELS", None)
    if kernels is None:
        print("error: models.attention has no KERNELS (the kernels have not landed)", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    unknown = [n for n in names if n not in kernels]
    if unknown or len(names) < 2:
        print(f"error: --kernels needs two or more of {', '.join(kernels)}; got {args.kernels!r}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(args.dtype)
    tol = args.tol if args.tol is not None else (1e-5 if dtype == jnp.float32 else 2e-2)
    b, s, kv, g, d = args.batch, args.seq, args.kv_heads, args.groups, args.head_dim
    keys = jax.random.split(jax.random.key(0), 4)
    q32 = jax.random.normal(keys[0], (b, s, kv, g, d), jnp.float32)
    k32 = jax.random.normal(keys[1], (b, s, kv, d), jnp.float32)
    v32 = jax.random.normal(keys[2], (b, s, kv, d), jnp.float32)
    cotangent32 = jax.random.normal(keys[3], (b, s, kv, g, d), jnp.float32)
    positions = np.arange(s, dtype=np.int32)  # a constant while tracing, as the fused kernels need
    device = jax.devices()[0]
    print(f"q {q32.shape}, k/v {k32.shape}, {args.dtype}, positions 0..{s - 1}; {device.platform} "
          f"({device.device_kind}), jax {jax.__version__}")

    def forward_and_grads(kernel, dtype):
        def run(q, k, v, cotangent):
            out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, Mask(positions, positions)), q, k, v)
            return (out, *vjp(cotangent.astype(out.dtype)))
        return jax.jit(run), tuple(x.astype(dtype) for x in (q32, k32, v32, cotangent32))

    reference_fn, reference_in = forward_and_grads(kernels["xla"], jnp.float32)
    reference = [np.asarray(x, np.float32) for x in reference_fn(*reference_in)]
    results, failed = {}, False
    for name in names:
        kernel = kernels[name]
        if name == "splash" and args.interpret:
            kernel = functools.partial(kernel, interpret=True)
        told_before = set(getattr(attention, "_told", set()))
        try:
            fn, inputs = forward_and_grads(kernel, dtype)
            outputs = jax.block_until_ready(fn(*inputs))
        except Exception as exc:  # noqa: BLE001 - a kernel this backend lacks: report it, go on
            print(f"{name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            failed = True
            continue
        fell_back = [why for kernel_name, why in set(getattr(attention, "_told", set())) - told_before
                     if kernel_name == name]
        if fell_back:
            print(f"{name}: fell back to the chunked kernel ({fell_back[0]}): not compared")
            failed = True
            continue
        start = time.perf_counter()
        for _ in range(args.repeats):
            timed = fn(*inputs)
        jax.block_until_ready(timed)
        seconds = (time.perf_counter() - start) / args.repeats
        results[name] = [np.asarray(x, np.float32) for x in outputs]
        errors = ", ".join(f"{what} {relative(x, r):.2e}" for what, x, r in zip(PARTS, results[name], reference))
        print(f"{name}: forward + backward {seconds * 1e3:.2f} ms; against float32 xla: {errors}")
    for first, name in itertools.combinations(results, 2):
        diffs = [(what, relative(x, y, r)) for what, x, y, r in zip(PARTS, results[first], results[name], reference)]
        ok = all(diff <= tol for _, diff in diffs)
        failed |= not ok
        print(f"{first} vs {name}: " + ", ".join(f"{what} {diff:.2e}" for what, diff in diffs) +
              f" (tolerance {tol:g}): {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


PARTS = ("out", "dq", "dk", "dv")


def relative(x, y, scale=None) -> float:
    """||x - y|| / ||scale|| (scale: y)."""
    import numpy as np

    scale = y if scale is None else scale
    return float(np.linalg.norm((x - y).ravel()) / max(np.linalg.norm(scale.ravel()), 1e-30))


if __name__ == "__main__":
    sys.exit(main())
