"""`python -m spmd.generate`: sample from a run's checkpoint or a Hugging Face model on a mesh.

    python -m spmd.generate --checkpoint runs/a --prompt "Once upon a time" --max-new-tokens 64
    python -m spmd.generate --init-from Llama-3.2-1B --mesh tp=2 --prompts prompts.jsonl \\
        --temperature 0.7 --top-p 0.9 --output completions.jsonl

Prompts are tokenized with the run's tokenizer (a Hugging Face directory's tokenizer.json;
UTF-8 bytes for a run without one), batched `--batch-size` at a time, padded to a few
bucket lengths, prefilled into a key/value cache and continued in one compiled loop
(spmd.decode). A completion ends at the tokenizer's end-of-text token or at the first
`--stop` text; an id that is no text under the tokenizer prints as U+FFFD.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from spmd.config import (DTYPES, Bounds, OneLineErrorParser, TrainConfig, finite, flag_of, integer, model_config,
                         nonempty, validate)
from spmd.errors import EXIT_OUTPUT_FAILED, UserError, one_line_errors, quiet_library_threads
from spmd.paths import Output, claim, regular_file
from spmd.signals import STOPPED
from spmd.signals import serve as serve_signals

if TYPE_CHECKING:  # imported where used: numpy starts threads, and main serves signals before any thread
    import numpy as np

DEFAULT_NEW_TOKENS = 64
# The flags' ranges. A seed has training's: JAX keeps 32 bits of it (2**32 would draw as 0).
BOUNDS = {"max_new_tokens": Bounds(at_least=1), "temperature": Bounds(at_least=0), "top_k": Bounds(at_least=0),
          "top_p": Bounds(above=0, at_most=1), "batch_size": Bounds(at_least=1),
          "seed": next(f.metadata["bounds"] for f in dataclasses.fields(TrainConfig) if f.name == "seed")}


def generate_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.generate", description=__doc__.splitlines()[0])
    add_model_source(parser)
    parser.add_argument("--prompt", action="append", type=str, default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", type=nonempty, help="a .jsonl file of {\"prompt\": TEXT} records")
    parser.add_argument("--max-new-tokens", type=integer,
                        help="tokens to generate per prompt (default: 64, or fewer to stay in the trained context)")
    parser.add_argument("--temperature", type=finite, default=0.0, help="0: greedy (default); else sample")
    parser.add_argument("--top-k", type=integer, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=finite, default=1.0, help="sample from the smallest set of tokens whose "
                        "probability reaches p (1: all)")
    parser.add_argument("--seed", type=integer, default=0,
                        help="seed of the draws, 0 to 2**32 - 1 (the same text on any mesh)")
    parser.add_argument("--stop", action="append", type=nonempty, default=[], help="end a completion at this text")
    parser.add_argument("--batch-size", type=integer, default=8, help="prompts decoded together (8)")
    parser.add_argument("--output", type=nonempty,
                        help="write one JSON record per prompt to this .jsonl file (or to a stream: /dev/stdout, a FIFO)")
    parser.add_argument("--dtype", choices=DTYPES, help="compute dtype, and the key/value cache's (default: the run's)")
    return parser


def add_model_source(parser: OneLineErrorParser) -> None:
    """The flags that stand a model up on a mesh (shared with spmd.eval)."""
    parser.add_argument("--checkpoint", type=nonempty, help="a run directory (latest step) or one step's directory")
    parser.add_argument("--step", type=integer, help="which step of a run directory (default: the latest)")
    parser.add_argument("--init-from", type=nonempty, help="a Hugging Face model directory instead of a checkpoint")
    parser.add_argument("--mesh", type=nonempty, default="dp=1",
                        help="mesh axis sizes: tp splits the heads, dp/fsdp/ep the batch (default: one device)")
    parser.add_argument("--cpu-devices", type=integer, help="emulated CPU devices (default: what the mesh needs)")


def model_source(args):
    """The run's config, its checkpoint (None: --init-from) and its tokenizer file (None:
    bytes), checked before JAX starts."""
    from spmd.weights import check_source_flags, checkpoint_config

    if bool(args.checkpoint) == bool(args.init_from):
        raise UserError("give one of --checkpoint RUN and --init-from DIR")
    if args.step is not None and not args.checkpoint:
        raise UserError("--step applies to --checkpoint")
    check_source_flags(args.step, args.cpu_devices)
    if args.checkpoint:
        cfg, checkpoint = checkpoint_config(args.checkpoint, args.step)
        tokenizer = checkpoint.meta.get("config", {}).get("tokenizer")
    else:
        from spmd.hf import tokenizer_of

        cfg, checkpoint = validate(TrainConfig(init_from=args.init_from)), None
        tokenizer = tokenizer_of(args.init_from)
    if tokenizer and not Path(tokenizer).is_file():
        raise UserError(f"the run's tokenizer {tokenizer} is gone; the prompts cannot be tokenized")
    return cfg, checkpoint, tokenizer


def on_mesh(cfg, args, **overrides):
    """The run's config on `--mesh`, with `overrides` (checked)."""
    return validate(dataclasses.replace(cfg, mesh=args.mesh, cpu_devices=args.cpu_devices, **overrides))


def check_bounds(args, bounds: dict[str, Bounds]) -> None:
    """Each flag of `bounds` that was given holds its bounds."""
    for name, b in bounds.items():
        value = getattr(args, name)
        if value is not None and not b.holds(value):
            raise UserError(f"{flag_of(name)} must be {b}, got {value}")


def trained_context(cfg, checkpoint) -> int:
    """The longest sequence the model was trained on: the run's --seq, or config.json's
    max_position_embeddings (checked)."""
    from spmd.hf import max_positions

    if checkpoint is not None:
        return int(checkpoint.meta["config"]["seq"])
    return max_positions(cfg.init_from)


def new_tokens(encoded: list[np.ndarray], context: int, asked: int | None) -> int:
    """How many tokens to generate: `asked` (--max-new-tokens), or the default within the
    context; a prompt that leaves no room in the context is refused, naming it."""
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    length = len(encoded[longest])
    if length >= context:
        raise UserError(f"prompt {longest + 1} is too long: {length} tokens, and the model's trained context is "
                        f"{context} tokens (room is needed for at least one new token); shorten it")
    if asked is None:
        return min(DEFAULT_NEW_TOKENS, context - length)
    if length + asked > context:
        raise UserError(f"--max-new-tokens {asked}: with the longest prompt ({length} tokens) that is beyond the "
                        f"model's trained context of {context} tokens; give at most {context - length}")
    return asked


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if "" in prompts:
        raise UserError("argument --prompt: the value is empty")
    if args.prompts:
        from spmd.corpus import jsonl_texts

        path = regular_file(args.prompts, "--prompts")
        prompts += jsonl_texts(path, "prompt", "--prompts", field_flag=None)
        if not prompts:
            raise UserError(f"--prompts {args.prompts} holds no prompt")
    if not prompts:
        raise UserError("no prompt: give --prompt TEXT or --prompts FILE.jsonl")
    return prompts


def claim_output(args, checkpoint, tokenizer: str | None):
    """--output, checked before any work: never over what is read (the prompts, the
    checkpoint's run, the model's directory, the tokenizer), never replacing a special file."""
    if not args.output:
        return None
    inputs = {"--prompts": args.prompts, "--checkpoint": checkpoint.run_dir if checkpoint else None,
              "--init-from": args.init_from, "the tokenizer": tokenizer}
    return claim([Output("--output", args.output)], inputs)["--output"]


def main(argv=None) -> int:
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: Ctrl-C ends in one line
    parser = generate_parser()
    restore = quiet_library_threads()
    try:
        with one_line_errors():
            args = parser.parse_args(argv)
            check_bounds(args, BOUNDS)
            prompts = read_prompts(args)
            cfg, checkpoint, tokenizer_path = model_source(args)
            output = claim_output(args, checkpoint, tokenizer_path)
            cfg = on_mesh(cfg, args, moe_dispatch="dropless", dtype=args.dtype or cfg.dtype)
            from spmd.corpus import check_vocab, load_tokenizer

            tokenizer = load_tokenizer(tokenizer_path)
            vocab = model_config(cfg).vocab
            check_vocab(tokenizer, vocab, "the tokenizer")
            if args.top_k > vocab:
                raise UserError(f"--top-k {args.top_k} is more than the model's vocabulary of {vocab} tokens")
            encoded = [ids.astype("int32") for ids in tokenizer.encode(prompts)]
            empty = [i + 1 for i, ids in enumerate(encoded) if len(ids) == 0]
            if empty:
                raise UserError(f"prompt {empty[0]} is empty (no tokens)")
            args.max_new_tokens = new_tokens(encoded, trained_context(cfg, checkpoint), args.max_new_tokens)
            run = Generation(cfg, checkpoint, args, encoded)
        results = run.complete(encoded, tokenizer, prompts)
    finally:
        restore()
    say = sys.stderr if output and output.to_stdout else sys.stdout  # --output /dev/stdout: stdout is the records'
    for i, (prompt, r) in enumerate(zip(prompts, results)):
        print(f"--- {i + 1}: {len(r['prompt_tokens'])} + {len(r['completion_tokens'])} tokens\n"
              f"{prompt}{r['completion']}", file=say)
    for line in run.report:
        print(line, file=say)
    if output:
        records = [{"prompt": prompt} | r for prompt, r in zip(prompts, results)]
        try:
            output.write(lambda f: f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()))
        except OSError as exc:
            print(f"error: {output.failed(exc)}", file=sys.stderr, flush=True)
            return EXIT_OUTPUT_FAILED
    return 0


class Generation:
    """The model on its mesh, and the decoders compiled for each shape."""

    def __init__(self, cfg, checkpoint, args, encoded: list[np.ndarray]):
        from spmd.decode import Sampling, bucket
        from spmd.mesh import emulate_cpu_devices

        emulate_cpu_devices(cfg.mesh_spec.sizes, cfg.cpu_devices)
        from spmd.layout import make_layout
        from spmd.weights import load_params

        self.layout = make_layout(cfg, for_training=False)
        if self.layout.shape["pp"] > 1 or self.layout.shape["sp"] > 1:
            raise UserError("generation runs on dp, fsdp, ep and tp; give a mesh without pp and sp")
        # A completion ends at the end-of-text token, unless the model never saw text (the
        # built-in synthetic data, whose token 0 is a token like any other).
        self.ends_at_eos = checkpoint is None or checkpoint.meta.get("config", {}).get("data") is not None
        self.args, self.decoders, self.report, self.dtype = args, {}, [], cfg.dtype
        self.sampling = Sampling(args.temperature, args.top_k, args.top_p)
        shards = self.layout.batch_shards
        self.rows = min(args.batch_size, len(encoded))  # no batch beyond the prompts: rows of padding cost memory
        self.batch = -(-self.rows // shards) * shards  # whole rows for every batch shard
        # The largest shape's programs, compiled before the weights are placed: XLA's peak decides the fit.
        self.check_fit(self.decoder(bucket(max(map(len, encoded)))))
        started = time.perf_counter()
        self.params = load_params(cfg, self.layout, checkpoint)
        self.report.append(f"model {cfg.model_name} on {self.layout.describe()}, placed in "
                           f"{time.perf_counter() - started:.1f} s")

    def check_fit(self, decoder) -> None:
        """Refuse what will not fit the devices' memory (emulated CPU devices share the
        host's), rather than run into an out-of-memory error, as training does."""
        from spmd.hardware import device_memory
        from spmd.report import human_bytes

        memory = device_memory(self.layout.mesh.local_devices)
        stats = [s for s in (decoder.prefill.memory_analysis(), decoder.generate.memory_analysis()) if s is not None]
        peak = max((s.argument_size_in_bytes + s.output_size_in_bytes - s.alias_size_in_bytes + s.temp_size_in_bytes
                    for s in stats), default=0)
        if memory is not None and peak > memory[0]:
            cache = human_bytes(decoder.cache_bytes_per_device())
            raise UserError(f"generating needs {human_bytes(peak)} per device at its peak (a key/value cache of "
                            f"{self.batch} x {decoder.length} tokens takes {cache}), more than the "
                            f"{human_bytes(memory[0])} of {memory[1]}; give a smaller --batch-size or "
                            "--max-new-tokens, or use more devices")

    def decoder(self, prompt_len: int):
        from spmd.decode import Decoder

        if prompt_len not in self.decoders:
            decoder = Decoder(self.layout, self.batch, prompt_len, self.args.max_new_tokens, self.sampling,
                              self.dtype)
            decoder.compile()
            self.decoders[prompt_len] = decoder
        return self.decoders[prompt_len]

    def complete(self, encoded: list[np.ndarray], tokenizer, prompts: list[str]) -> list[dict]:
        import jax
        import numpy as np

        from spmd.decode import bucket, left_padded

        key = jax.random.key(self.args.seed)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))  # similar lengths share a bucket
        results: dict[int, dict] = {}
        timing = {"prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "new_tokens": 0, "first": []}
        for start in range(0, len(order), self.rows):
            chosen = order[start:start + self.rows]
            length = bucket(max(len(encoded[i]) for i in chosen))
            decoder = self.decoder(length)
            tokens, pads = left_padded([encoded[i] for i in chosen], self.batch, length)
            rows = np.full(self.batch, -1, np.int32)
            rows[:len(chosen)] = chosen
            began = time.perf_counter()
            cache, first = decoder.prefill(self.params, tokens, pads, rows, key)
            first.block_until_ready()
            prefilled = time.perf_counter()
            new = np.asarray(decoder.generate(self.params, cache, first, pads, rows, key))
            done = time.perf_counter()
            timing["prefill_s"] += prefilled - began
            timing["decode_s"] += done - prefilled
            timing["first"].append(prefilled - began)
            timing["prompt_tokens"] += sum(len(encoded[i]) for i in chosen)
            timing["new_tokens"] += len(chosen) * (self.args.max_new_tokens - 1)
            for row, i in enumerate(chosen):
                results[i] = self._completion(encoded[i], new[row], tokenizer)
        decoder = next(iter(self.decoders.values()))
        self.report += [
            f"prefill: {timing['prompt_tokens'] / max(timing['prefill_s'], 1e-9):,.0f} prompt tokens/s; time to the first token "
            f"{1000 * np.mean(timing['first']):.1f} ms per batch",
            f"decode: {timing['new_tokens'] / max(timing['decode_s'], 1e-9):,.0f} tokens/s "
            f"({len(prompts)} prompts, batches of {self.batch})",
            f"key/value cache: {decoder.cache_bytes_per_device() / 2**20:.2f} MiB per device for "
            f"{self.batch} x {decoder.length} tokens (the longest bucket's: "
            f"{max(d.cache_bytes_per_device() for d in self.decoders.values()) / 2**20:.2f} MiB)",
        ]
        return [results[i] for i in range(len(encoded))]

    def _completion(self, prompt: np.ndarray, new: np.ndarray, tokenizer) -> dict:
        ids = [int(t) for t in new]
        if self.ends_at_eos and tokenizer.eos in ids:
            ids = ids[:ids.index(tokenizer.eos)]
        text = tokenizer.decode(ids)
        for stop in self.args.stop:
            if stop in text:
                text = text[:text.index(stop)]
        return {"completion": text, "prompt_tokens": [int(t) for t in prompt], "completion_tokens": ids}


if __name__ == "__main__":
    sys.exit(main())
