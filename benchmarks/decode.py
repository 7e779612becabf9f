"""Decoding speed with the key/value cache (spmd.inference.decode), in one run:

1. decode tokens/s with the cache / tokens/s recomputing the whole sequence for each new
   token (the same model, batch and lengths, both one compiled scan over the new tokens);
2. decode time per token with 64 tokens of context in a cache of 576 slots / in one of 128:
   what the empty slots cost (attention reads the filled part only; goal 1.0);
3. decode time per token with 512 tokens of context / with 64, with the cache (a new token
   costs its own matmuls plus reading its context's keys and values) and recomputing (the
   whole context's matmuls again, and attention quadratic in it). Next to it, the same ratio
   of the bytes a step must read at least: every weight once and its context's keys and
   values. A memory-bound step can do no better than that ratio; at batch 8 the small
   model's K/V of 512 tokens outweigh its weights, so it is above 1.3 however attention
   is written (at batch 1 it is about 1.1);
4. with a latent-attention model (--model deepseek-v3-tiny): the cache's bytes per token, as
   the decoder allocates them, / what the same heads would cache as keys and values (a
   grouped-query cache with a key/value head per query head), and the same ratio for
   DeepSeek-V3's own shapes.

    python benchmarks/decode.py [--model small --mesh dp=1 --batch 8 --new 64]

Times are medians of alternating rounds (this machine's timings drift between minutes).
"""

import argparse
import statistics
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--mesh", default="dp=1")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from spmd.parallel.mesh import emulate_cpu_devices, parse_mesh

    emulate_cpu_devices(parse_mesh(args.mesh), None)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import PRESETS, model_class
    from spmd.config import TrainConfig, validate
    from spmd.inference.decode import Decoder, Sampling, left_padded
    from spmd.layout import make_layout

    layout = make_layout(validate(TrainConfig.of(model=args.model, mesh=args.mesh)), for_training=False)
    params = nnx.to_pure_dict(nnx.state(model_class(PRESETS[args.model])(PRESETS[args.model], rngs=nnx.Rngs(0)),
                                        nnx.Param))
    params = jax.device_put(params, layout.shardings(layout.rules.params))
    vocab = PRESETS[args.model].vocab
    rng = np.random.default_rng(0)

    decoders = {}

    def cached(context: int, slots: int = 0):
        decoder = decoders[context, slots] = Decoder(layout, args.batch, context, args.new, Sampling(), slots=slots)
        decoder.compile()
        tokens, pads = left_padded([rng.integers(0, vocab, context) for _ in range(args.batch)], args.batch, context)
        rows, key = np.arange(args.batch, dtype=np.int32), jax.random.key(0)

        def run() -> float:
            cache, first = decoder.prefill(params, tokens, pads, rows, key)
            jax.block_until_ready(first)
            start = time.perf_counter()
            jax.block_until_ready(decoder.generate(params, cache, first, pads, rows, key))
            return time.perf_counter() - start
        return run

    def recomputed(context: int):
        """The same greedy tokens with no cache: each step runs the whole (padded) sequence."""
        graph = layout.skeleton.graphdef
        width = context + args.new

        @jax.jit
        def generate(params, rows):
            def step(rows, t):
                logits = nnx.merge(graph, params)(rows)
                token = jnp.argmax(logits[:, context + t - 1], axis=-1).astype(jnp.int32)
                return rows.at[:, context + t].set(token), token
            return jax.lax.scan(step, rows, jnp.arange(args.new))[1]

        rows = np.zeros((args.batch, width), np.int32)
        rows[:, :context] = rng.integers(0, vocab, (args.batch, context))
        with jax.set_mesh(layout.mesh):
            jax.block_until_ready(generate(params, rows))

        def run() -> float:
            start = time.perf_counter()
            with jax.set_mesh(layout.mesh):
                jax.block_until_ready(generate(params, rows))
            return time.perf_counter() - start
        return run

    config = PRESETS[args.model]
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    def cache_per_token(cfg) -> int:
        """Elements the model's cache holds per token, over its layers."""
        return sum(np.prod(shape) for shape, _ in model_class(cfg).cache_layout(cfg, 1, 1).values())

    def context_bytes(context: int) -> float:
        """Bytes of the cache a decode step reads: its rows' context (on average context +
        new / 2 tokens over the new tokens)."""
        per_token = cache_per_token(config) * jnp.dtype(Decoder.cache_dtype).itemsize
        return per_token * args.batch * (context + args.new / 2)

    runs = {"cache, 64": cached(64), "recompute, 64": recomputed(64), "cache, 512": cached(512),
            "recompute, 512": recomputed(512), "big cache, 64": cached(64, slots=512 + args.new)}
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            times[name].append(run())
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens = args.batch * args.new
    for name, seconds in median.items():
        print(f"{name:>14} tokens of context: {tokens / seconds:10,.0f} new tokens/s ({1000 * seconds / args.new:.2f} "
              f"ms per step of {args.batch})")
    print(f"with the cache / recomputing: {median['recompute, 64'] / median['cache, 64']:.1f}x the tokens/s "
          f"({args.model}, 64 tokens of prompt, {args.new} new)")
    print(f"time per new token with 64 tokens of context, in a cache of {512 + args.new} slots / of {64 + args.new}: "
          f"{median['big cache, 64'] / median['cache, 64']:.2f}")
    print(f"time per new token, 512 / 64 tokens of context: {median['cache, 512'] / median['cache, 64']:.2f} with "
          f"the cache, {median['recompute, 512'] / median['recompute, 64']:.2f} recomputing")
    # What a step reads at least: every weight once, and its context's keys and values.
    least = {context: weight_bytes + context_bytes(context) for context in (64, 512)}
    print(f"bytes a step reads at least, 512 / 64 tokens of context: {least[512] / least[64]:.2f} "
          f"({weight_bytes / 2**20:.1f} MiB of weights; keys and values {context_bytes(512) / 2**20:.1f} "
          f"and {context_bytes(64) / 2**20:.1f} MiB)")

    if hasattr(config, "latent_dim"):  # latent attention: its cache against full keys and values per head
        decoder = decoders[64, 0]
        allocated = decoder.cache_bytes_per_device() / (args.batch * decoder.length * config.layers)
        for name, cfg, per_layer in ((args.model, config, allocated / jnp.dtype(Decoder.cache_dtype).itemsize),
                                     ("deepseek-v3", PRESETS["deepseek-v3"], None)):
            latent = per_layer or cache_per_token(cfg) / cfg.model.layers
            heads = cfg.heads * (cfg.head_dim + cfg.v_dim)  # keys of head_dim and values of v_dim, per head
            print(f"cache per token and layer, {name}: {latent:,.0f} numbers (latent {cfg.kv_rank} + rotary key "
                  f"{cfg.rope_dim}{', as allocated' if per_layer else ''}); keys and values per head would be "
                  f"{heads:,}: {heads / latent:.1f}x as many")


if __name__ == "__main__":
    main()
