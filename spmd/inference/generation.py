"""`python -m spmd.generate`'s library: the model a checkpoint or a Hugging Face directory
names, stood up on a mesh, and its prompts completed with the decoders of spmd.inference.decode.
The model-source flags and checks are shared with `spmd.eval`."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from spmd.base.console import human_bytes
from spmd.base.errors import UserError
from spmd.base.hardware import device_memory
from spmd.base.paths import regular_file
from spmd.data.corpus import jsonl_texts
from spmd.formats.hf import max_positions, tokenizer_of
from spmd.inference.decode import Decoder, Sampling, bucket, left_padded
from spmd.parallel.layout import make_layout
from spmd.run.config import TrainConfig
from spmd.run.resolve import validate
from spmd.run.weights import check_source_flags, checkpoint_config, load_params

DEFAULT_NEW_TOKENS = 64


def model_source(args):
    """The run's config, its checkpoint (None: --init-from) and its tokenizer file (None:
    bytes), checked before JAX starts."""
    if bool(args.checkpoint) == bool(args.init_from):
        raise UserError("give one of --checkpoint RUN and --init-from DIR")
    if args.step is not None and not args.checkpoint:
        raise UserError("--step applies to --checkpoint")
    if args.adapter and not args.init_from:
        raise UserError("--adapter applies to --init-from; a LoRA run's checkpoint holds its adapters")
    check_source_flags(args.step, args.cpu_devices)
    if args.checkpoint:
        cfg, checkpoint = checkpoint_config(args.checkpoint, args.step)
        tokenizer = checkpoint.meta.get("config", {}).get("tokenizer")
    else:
        cfg, checkpoint = validate(TrainConfig.of(init_from=args.init_from, adapter=args.adapter)), None
        tokenizer = tokenizer_of(args.init_from)
    if tokenizer and not Path(tokenizer).is_file():
        raise UserError(f"the run's tokenizer {tokenizer} is gone; the prompts cannot be tokenized")
    return cfg, checkpoint, tokenizer


def on_mesh(cfg, args, **overrides):
    """The run's config on `--mesh` (none: the default layout of the devices found, chosen
    once they are there), with `overrides` (checked)."""
    return validate(cfg.replace(mesh=args.mesh, cpu_devices=args.cpu_devices, **overrides))


def trained_context(cfg, checkpoint) -> int:
    """The longest sequence the model was trained on: the run's --seq, or config.json's
    max_position_embeddings (checked)."""
    if checkpoint is not None:
        return int(checkpoint.meta["config"]["seq"])
    return max_positions(cfg.model.init_from)


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
        path = regular_file(args.prompts, "--prompts")
        prompts += jsonl_texts(path, "prompt", "--prompts", field_flag=None)
        if not prompts:
            raise UserError(f"--prompts {args.prompts} holds no prompt")
    if not prompts:
        raise UserError("no prompt: give --prompt TEXT or --prompts FILE.jsonl")
    for i, prompt in enumerate(prompts):
        try:
            prompt.encode()
        except UnicodeEncodeError:  # bytes of the command line that are no UTF-8, or a JSON "\ud800"
            raise UserError(f"prompt {i + 1} is not UTF-8 text (it holds {prompt[:40]!r}); give it as UTF-8") from None
    return prompts


class Generation:
    """The model on its mesh, and the decoders compiled for each shape."""

    def __init__(self, cfg, checkpoint, args, encoded: list[np.ndarray]):
        """`cfg` on its mesh, its devices started (spmd.run.bootstrap.start_devices_and_mesh)."""
        self.layout = make_layout(cfg.step, for_training=False)
        if self.layout.shape["pp"] > 1 or self.layout.shape["sp"] > 1:
            raise UserError("generation runs on dp, fsdp, ep and tp; give a mesh without pp and sp")
        # A completion ends at the end-of-text token, unless the model never saw text (the
        # built-in synthetic data, whose token 0 is a token like any other).
        self.ends_at_eos = checkpoint is None or checkpoint.meta.get("config", {}).get("data") is not None
        self.args, self.decoders, self.report, self.dtype = args, {}, [], cfg.model.dtype
        self.sampling = Sampling(args.temperature, args.top_k, args.top_p)
        shards = self.layout.batch_shards
        self.rows = min(args.batch_size, len(encoded))  # no batch beyond the prompts: rows of padding cost memory
        self.batch = -(-self.rows // shards) * shards  # whole rows for every batch shard
        # The largest shape's programs, compiled before the weights are placed: XLA's peak decides the fit.
        self.check_fit(self.decoder(bucket(max(map(len, encoded)))))
        started = time.perf_counter()
        self.params = load_params(cfg, self.layout, checkpoint)
        self.report.append(f"model {cfg.model.name} on {self.layout.describe()}, placed in "
                           f"{time.perf_counter() - started:.1f} s")

    def check_fit(self, decoder) -> None:
        """Refuse what will not fit the devices' memory (emulated CPU devices share the
        host's), rather than run into an out-of-memory error, as training does."""
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
        if prompt_len not in self.decoders:
            decoder = Decoder(self.layout, self.batch, prompt_len, self.args.max_new_tokens, self.sampling,
                              self.dtype)
            decoder.compile()
            self.decoders[prompt_len] = decoder
        return self.decoders[prompt_len]

    def complete(self, encoded: list[np.ndarray], tokenizer, prompts: list[str]) -> list[dict]:
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

