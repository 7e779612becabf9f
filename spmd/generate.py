"""`python -m spmd.generate`: sample from a run's checkpoint or a Hugging Face model on a mesh.

    python -m spmd.generate --checkpoint runs/a --prompt "Once upon a time" --max-new-tokens 64
    python -m spmd.generate --init-from Llama-3.2-1B --mesh tp=2 --prompts prompts.jsonl \\
        --temperature 0.7 --top-p 0.9 --output completions.jsonl

Prompts are tokenized with the run's tokenizer (a Hugging Face directory's tokenizer.json;
UTF-8 bytes for a run without one), or with `--chat` rendered as a user's message by the
tokenizer directory's chat template; batched `--batch-size` at a time, padded to a few
bucket lengths, prefilled into a key/value cache and continued in one compiled loop
(spmd.inference.generation and spmd.inference.decode). A completion ends at the
tokenizer's end-of-text token or at the first `--stop` text; an id that is no text under
the tokenizer prints as U+FFFD.
"""

from __future__ import annotations

import json
import sys

from spmd.base.cli import (COUNT, DTYPES, SEED, SEQ, TOKENS_PER_STEP, OneLineErrorParser, add_model_source,
                           check_bounds, finite, integer, nonempty)
from spmd.base.errors import EXIT_OUTPUT_FAILED, UserError, one_line_errors, quiet_library_threads
from spmd.base.paths import Output, claim
from spmd.base.schema import Bounds
from spmd.base.signals import STOPPED
from spmd.base.signals import serve as serve_signals

# The flags' ranges (a seed has training's; the new tokens, with the prompt, make a sequence: --seq's).
# A temperature is 0 (greedy) or at least MIN_TEMPERATURE: float32 logits divided by less leave the numbers.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
BOUNDS = {"max_new_tokens": Bounds(at_least=1, at_most=SEQ.at_most),
          "temperature": Bounds(at_least=0, at_most=MAX_TEMPERATURE),
          "top_k": Bounds(at_least=0, at_most=COUNT.at_most), "top_p": Bounds(above=0, at_most=1), "batch_size": Bounds(at_least=1, at_most=TOKENS_PER_STEP),
          "seed": SEED}


def generate_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog="python -m spmd.generate", description=__doc__.splitlines()[0])
    add_model_source(parser)
    parser.add_argument("--prompt", action="append", type=str, default=[], help="a prompt (repeat for several)")
    parser.add_argument("--prompts", type=nonempty, help="a .jsonl file of {\"prompt\": TEXT} records")
    parser.add_argument("--chat", action="store_true", help="each prompt is a user's message, rendered by the "
                        "tokenizer directory's chat template with the generation prompt (as apply_chat_template)")
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


def claim_output(args, source: dict):
    """--output, checked before any work: never over what is read (the prompts, and what
    the model comes from: `source`, spmd.run.weights.source_inputs), never replacing a
    special file."""
    if not args.output:
        return None
    return claim([Output("--output", args.output)], {"--prompts": args.prompts, **source})["--output"]


def main(argv=None) -> int:
    serve_signals("stopped; nothing was written", STOPPED)  # first, before any thread: Ctrl-C ends in one line
    parser = generate_parser()
    restore = quiet_library_threads()
    try:
        with one_line_errors():
            args = parser.parse_args(argv)
            check_bounds(args, BOUNDS)
            if 0 < args.temperature < MIN_TEMPERATURE:
                raise UserError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                                f"got {args.temperature:g}")
            # The library is imported once signals are served, before numpy starts its threads.
            from spmd.data.records import chat_prompt
            from spmd.data.tokenizer import check_vocab, load_tokenizer, load_tokenizer_directory
            from spmd.inference.generation import (Generation, model_source, new_tokens, on_mesh, read_prompts,
                                                   trained_context)
            from spmd.run.bootstrap import start_devices_and_mesh
            from spmd.run.weights import source_inputs

            prompts = read_prompts(args)
            cfg, checkpoint, tokenizer_path = model_source(args)
            output = claim_output(args, source_inputs(args, checkpoint))
            cfg = on_mesh(cfg, args, moe_dispatch="dropless", dtype=args.dtype or cfg.model.dtype)

            if args.chat:
                tokenizer = load_tokenizer_directory(tokenizer_path, "chat prompts (--chat)")
            else:
                tokenizer = load_tokenizer(tokenizer_path)
            vocab = cfg.model_cfg.vocab
            check_vocab(tokenizer, vocab, "the tokenizer")
            if args.top_k > vocab:
                raise UserError(f"--top-k {args.top_k} is more than the model's vocabulary of {vocab} tokens")
            if args.chat:
                encoded = [chat_prompt(prompt, tokenizer).astype("int32") for prompt in prompts]
            else:
                encoded = [ids.astype("int32") for ids in tokenizer.encode(prompts)]
            empty = [i + 1 for i, ids in enumerate(encoded) if len(ids) == 0]
            if empty:
                raise UserError(f"prompt {empty[0]} is empty (no tokens)")
            args.max_new_tokens = new_tokens(encoded, trained_context(cfg, checkpoint), args.max_new_tokens)
            cfg, layout_line = start_devices_and_mesh(cfg, for_training=False)
            run = Generation(cfg, checkpoint, args, encoded)
        results = run.complete(encoded, tokenizer, prompts)
    finally:
        restore()
    say = sys.stderr if output and output.to_stdout else sys.stdout  # --output /dev/stdout: stdout is the records'
    if layout_line:
        print(layout_line, file=say)
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


if __name__ == "__main__":
    sys.exit(main())
