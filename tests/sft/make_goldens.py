"""Make the fine-tuning goldens that tests/test_records.py checks spmd.data.records against
(run by hand; needs torch, transformers and TRL, which the tests do not):

    pip install torch transformers trl jinja2 && python tests/sft/make_goldens.py

It writes two small tokenizer directories in the Hugging Face layout and, in goldens.json,
the token ids and loss masks that transformers (and TRL's rules, restated below from
trl/trainer/sft_trainer.py) give for a handful of records:

- chatml/: a byte-level BPE; tokenizer_config.json holds the special tokens (a `pad_token`
  that tokenizer.json lacks, which transformers adds), `added_tokens_decoder`, and a
  ChatML template with `{% generation %}` blocks. Its special_tokens_map.json names
  another end-of-text token: transformers reads that legacy file only when the config has
  no `added_tokens_decoder`, so it must be ignored here.
- llama/: a Metaspace (SentencePiece-like) BPE whose post-processor prepends
  <|begin_of_text|> as Llama 3's does; `add_eos_token: true` in tokenizer_config.json,
  which transformers 5 ignores when a tokenizer.json is present; the special tokens come
  from special_tokens_map.json (no `added_tokens_decoder`); the template, without
  generation blocks, is chat_template.jinja (which wins over the config's own), and it
  reads a model-specific token (`start_token`). Its reference masks come from the same
  template with generation blocks around each assistant turn and its end-of-turn token,
  which is what spmd's fallback (content + a special token right after it) must give.

The rules, per record (TRL 1.16's SFTTrainer, completion_only_loss on):
- text: ids of text + eos_token (unless it ends with it), special tokens added; loss on all.
- prompt/completion strings: completion += eos_token unless it ends with it; ids of
  prompt + completion, special tokens added; loss from the first id that differs from
  the prompt's own ids (trl.data_utils.common_prefix_length).
- prompt/completion message lists: prompt ids from the template with the generation
  prompt, then ids of the template over prompt + completion; loss as above.
- messages: apply_chat_template(messages, tokenize=True, return_dict=True,
  return_assistant_tokens_mask=True); loss on the assistant mask.

The entries qwen2.5 and qwen3 hold those templates as published (the text TRL recognizes
them by) over the chatml tokenizer, with the ids and masks TRL makes through the training
template it swaps in for them (published_template_goldens).

It also writes (make_model) a tiny random LlamaForCausalLM with the chatml tokenizer in
model/, two data files (prompt_completion.jsonl, chat.jsonl) and, in model_losses.json,
the loss transformers computes for each file's records by the rules above: per record
(batch 1, no padding) the summed NLL of its targets and their count, labels shifted by
one as transformers shifts them, and the token-weighted mean over the file.
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

HERE = Path(__file__).parent
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog.", "what is the capital of France? Paris.",
    "Traduis : le chat est là → the cat is there 🐱.", "café, naïve, Straße, 東京, привет",
    "system user assistant tool: answer briefly, be helpful.", "hello world, hi there, say hi.",
    "def add(a, b):\n    return a + b\n", "weather in Paris today: sunny, 21 °C.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 {}[]<>|\"'_-+=*/\\!?;:",
] * 4

# ChatML with the assistant's turns (content and end-of-turn) in generation blocks.
CHATML = """\
{%- if tools %}
<|im_start|>system
Tools: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message.content }}<|im_end|>{% endgeneration %}

{% else %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

# The same turns after a BOS, written with expressions; GENERATION marks where the
# reference variant puts its blocks.
LLAMA = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- start_token + 'assistant\\n' }}GEN{{- message.content + '<|im_end|>' }}END
{{- '\\n' }}
{%- else %}
{{- start_token + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- start_token + 'assistant\\n' }}
{%- endif %}"""
LLAMA_PLAIN = LLAMA.replace("GEN", "").replace("END", "")
LLAMA_GENERATION = LLAMA.replace("GEN", "{% generation %}").replace("END", "{% endgeneration %}")
# Assistant content trimmed, as many templates do: spmd then finds it by searching.
TRIMMED = ("message.content + '<|im_end|>'", "message.content | trim + '<|im_end|>'")
LLAMA_TRIM_PLAIN, LLAMA_TRIM_GENERATION = LLAMA_PLAIN.replace(*TRIMMED), LLAMA_GENERATION.replace(*TRIMMED)

PROMPT_COMPLETION = [
    {"prompt": "What is the capital of France?", "completion": " Paris."},
    {"prompt": "Traduis : le chat → ", "completion": "le chat 🐱 est là"},
    {"prompt": "Say hi", "completion": " hi{eos}"},  # already ends with the end-of-text token
    {"prompt": "", "completion": "Just text."},
    {"prompt": "Question?", "completion": ""},
    {"prompt": "hel", "completion": "lo world"},  # the boundary falls inside a token
    {"prompt": "<|im_start|>user said <|pad|>", "completion": " ok"},  # special tokens in the text
]
TEXT = [{"text": "the lazy dog sleeps."}, {"text": "café 東京 ends with eos{eos}"}]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [{"role": "system", "content": "Answer briefly, en français."},
     {"role": "user", "content": "Traduis : the cat"}, {"role": "assistant", "content": "le chat 🐱"},
     {"role": "user", "content": "et le chien ?"}, {"role": "assistant", "content": "le chien"}],
    [{"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "content": "Let me look."},
     {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "assistant", "content": "sunny, 21 °C"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""},
     {"role": "user", "content": " \n"}, {"role": "assistant", "content": "  spaced out \n"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi"},  # the same text twice
     {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi hi"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hi "},  # trimmed by LLAMA_TRIM
     {"role": "user", "content": "hi"}, {"role": "assistant", "content": " hi"}],
    [{"role": "user", "content": "say it"}, {"role": "assistant", "content": "\n  spaced out \n"}],
]
# Qwen3's template reads reasoning from a message's field or from a <think> block in its content.
QWEN3_CHATS = [
    [{"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4", "reasoning_content": "two twos"},
     {"role": "user", "content": "and 3 + 3?"}, {"role": "assistant", "content": "<think>\nthree, twice\n</think>\n\n6"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "météo à Paris",
                                           "parameters": {"type": "object", "properties": {}}}}]
CONVERSATIONAL_PROMPT_COMPLETION = [
    {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2 + 2?"}],
     "completion": [{"role": "assistant", "content": "4"}]},
]

# The tiny model's data (make_model): prompt_completion.jsonl (8-40 tokens a record with
# the chatml tokenizer, its eos appended) and chat.jsonl (15-60 tokens rendered).
MODEL_PROMPT_COMPLETION = [
    ("What is 2 + 3?", " 5."), ("What is 7 times 6?", " 42."),
    ("What is the capital of France?", " Paris."), ("What is the capital of Italy?", " Rome."),
    ("The capital of Japan is", " Tokyo (東京)."), ("Say hello in French:", " bonjour, ça va ?"),
    ("Complete: the quick brown fox", " jumps over the lazy dog."), ("Is ice cold?", " Yes, ice is cold."),
    ("Name a primary color.", " Blue."), ("How many legs does a cat have?", " Four."),
    ("Spell cat backwards.", " tac"), ("The German word for street is", " Straße."),
]
SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
MODEL_CHATS = [
    [(USER, "What is 2 + 2?"), (ASSISTANT, "4.")],
    [(SYSTEM, "Be brief."), (USER, "Capital of Spain?"), (ASSISTANT, "Madrid.")],
    [(USER, "Hi!"), (ASSISTANT, "Hello!"), (USER, "What is 3 + 4?"), (ASSISTANT, "7.")],
    [(SYSTEM, "Answer in French."), (USER, "Thank you"), (ASSISTANT, "Merci.")],
    [(USER, "Capital of Peru?"), (ASSISTANT, "Lima."), (USER, "Cuba?"), (ASSISTANT, "Havana.")],
    [(SYSTEM, "You are a math tutor."), (USER, "What is 10 - 3?"), (ASSISTANT, "It is 7.")],
    [(USER, "Name a fruit."), (ASSISTANT, "An apple.")],
    [(SYSTEM, "Be brief."), (USER, "2 * 5?"), (ASSISTANT, "10."), (USER, "Half?"), (ASSISTANT, "5.")],
    [(USER, "Say hi in Japanese."), (ASSISTANT, "こんにちは")],
    [(USER, "Is the sky blue?"), (ASSISTANT, "Yes, on a clear day.")],
    [(SYSTEM, "Reply in one word."), (USER, "Color of grass?"), (ASSISTANT, "Green.")],
    [(USER, "Count to 3."), (ASSISTANT, "1, 2, 3"), (USER, "Back?"), (ASSISTANT, "3, 2, 1")],
]
# The model: the shape of tests/hf's, the chatml tokenizer's vocabulary (401 with the
# added <|pad|>) rounded up to a multiple of 8.
MODEL_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   intermediate_size=64, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False,
                   rms_norm_eps=1e-5)


def train(pre_tokenizer, decoder, vocab: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoder
    alphabet = pre_tokenizers.ByteLevel.alphabet() if isinstance(pre_tokenizer, pre_tokenizers.ByteLevel) else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                        initial_alphabet=alphabet, show_progress=False))
    return tok


def write_json(path: Path, value, depth: int = 99) -> None:
    """`value` indented down to `depth` levels, each deeper value on one line."""
    def written(v, level: int) -> str:
        if level >= depth or not isinstance(v, (dict, list)) or not v:
            return json.dumps(v, ensure_ascii=False)
        pad = " " * (level + 1)
        items = ([f"{json.dumps(k, ensure_ascii=False)}: {written(x, level + 1)}" for k, x in v.items()]
                 if isinstance(v, dict) else [written(x, level + 1) for x in v])
        ends = "{}" if isinstance(v, dict) else "[]"
        return ends[0] + "\n" + ",\n".join(pad + i for i in items) + "\n" + " " * level + ends[1]
    path.write_text(written(value, 0) + "\n")


def make_chatml(out: Path) -> None:
    tok = train(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel(), 400)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIALS}
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "unk_token": "<unk>", "chat_template": CHATML,
        "model_max_length": 4096})
    write_json(out / "special_tokens_map.json", {"eos_token": "<|end_of_text|>"})


def make_llama(out: Path) -> None:
    tok = train(pre_tokenizers.Metaspace(prepend_scheme="first"), decoders.Metaspace(prepend_scheme="first"), 300)
    bos = "<|begin_of_text|>"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(out / "tokenizer.json"))
    write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": True,
        "start_token": "<|im_start|>", "chat_template": "{{ raise_exception('the .jinja file wins') }}"})
    write_json(out / "special_tokens_map.json", {
        "bos_token": bos, "eos_token": {"content": "<|end_of_text|>", "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False}})
    (out / "chat_template.jinja").write_text(LLAMA_PLAIN)


def with_eos(record: dict, eos: str) -> dict:
    return {k: v.replace("{eos}", eos) if isinstance(v, str) else v for k, v in record.items()}


def goldens(name: str, template: str | None = None, reference: str | None = None) -> list[dict]:
    """The records' ids and masks by the tokenizer `name`; with `template` (instead of its
    own), its chats alone. The masks come from `reference` (a template with generation
    blocks) where given."""
    tok = AutoTokenizer.from_pretrained(HERE / name)
    found = []
    if template is not None:
        tok.chat_template = template
    else:
        found += text_goldens(tok)
    for messages in CHATS:
        if template is not None and any(m["role"] == "assistant" and not m["content"] for m in messages):
            continue  # found by its content, an empty assistant message is nowhere: spmd marks nothing for it
        records = [{"messages": messages}] + ([{"messages": messages, "tools": TOOLS}] if name == "chatml" else [])
        for record in records:
            out = tok.apply_chat_template(messages, tools=record.get("tools"), tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=reference is None)
            if reference is not None:
                masked = tok.apply_chat_template(messages, chat_template=reference, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
                assert masked["input_ids"] == out["input_ids"], "the reference template renders other tokens"
                out["assistant_masks"] = masked["assistant_masks"]
            found.append({"record": record, "input_ids": out["input_ids"], "loss": out["assistant_masks"]})
    if name == "chatml":
        for record in CONVERSATIONAL_PROMPT_COMPLETION:
            prompt_ids = tok.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
            ids = tok.apply_chat_template(record["prompt"] + record["completion"], tokenize=True,
                                          return_dict=True)["input_ids"]
            found.append({"record": record, "input_ids": ids, "loss": after(prompt_ids, ids)})
    return found


def published_template_goldens() -> dict:
    """Qwen2.5's and Qwen3's published chat templates (the text TRL recognizes them by) over
    the chatml tokenizer: the chats' ids and masks as TRL's SFTTrainer makes them with
    assistant_only_loss, through the training template it swaps in
    (trl.chat_template_utils.get_training_chat_template)."""
    from trl import chat_template_utils as trl_templates

    found = {}
    for name, published in (("qwen2.5", trl_templates.qwen2_5_chat_template),
                            ("qwen3", trl_templates.qwen3_chat_template)):
        tok = AutoTokenizer.from_pretrained(HERE / "chatml")
        tok.chat_template = published
        training = trl_templates.get_training_chat_template(tok)
        records = []
        for messages in CHATS + QWEN3_CHATS:
            for tools in (None, TOOLS):
                out = tok.apply_chat_template(messages, tools=tools, chat_template=training, tokenize=True,
                                              return_dict=True, return_assistant_tokens_mask=True)
                record = {"messages": messages} | ({"tools": tools} if tools else {})
                records.append({"record": record, "input_ids": out["input_ids"], "loss": out["assistant_masks"]})
        found[name] = {"directory": "chatml", "chat_template": published, "records": records}
    return found


def text_goldens(tok) -> list[dict]:
    """Text and prompt/completion strings, by TRL's rules."""
    found = []
    for record in [with_eos(r, tok.eos_token) for r in TEXT]:
        text = record["text"] if record["text"].endswith(tok.eos_token) else record["text"] + tok.eos_token
        ids = tok(text=text)["input_ids"]
        found.append({"record": record, "input_ids": ids, "loss": [1] * len(ids)})
    for record in [with_eos(r, tok.eos_token) for r in PROMPT_COMPLETION]:
        ids, loss = prompt_completion(tok, record)
        found.append({"record": record, "input_ids": ids, "loss": loss})
    return found


def prompt_completion(tok, record: dict) -> tuple[list, list]:
    """A prompt/completion string record's ids and loss mask, by TRL's rules."""
    completion = record["completion"]
    completion += "" if completion.endswith(tok.eos_token) else tok.eos_token
    prompt_ids = tok(text=record["prompt"])["input_ids"]
    ids = tok(text=record["prompt"] + completion)["input_ids"]
    return ids, after(prompt_ids, ids)


def after(prompt_ids: list, ids: list) -> list:
    """TRL's completion mask (1.16, common_prefix_length): 0 while the ids are the
    prompt's own, 1 from where they differ (a token may span the boundary)."""
    same = next((i for i, (a, b) in enumerate(zip(prompt_ids, ids)) if a != b), min(len(prompt_ids), len(ids)))
    return [0] * same + [1] * (len(ids) - same)


def write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def make_model() -> None:
    """model/ (a tiny random LlamaForCausalLM in float32 with the chatml tokenizer), the
    data files prompt_completion.jsonl and chat.jsonl, and model_losses.json: each file's
    records' ids, loss masks and the NLL transformers' model gives their targets."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # One thread: the float sums (and so the losses' last digits) then do not depend on
    # how many cores the machine has.
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(HERE / "chatml")
    config = LlamaConfig(vocab_size=-(-len(tok) // 8) * 8, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **MODEL_SHAPE)
    torch.manual_seed(sum(map(ord, "sft")))
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # as tests/hf's: larger weights than the 0.02 default, so that layers matter
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.uniform_(0.5, 1.5)
    out = HERE / "model"
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(HERE / "chatml" / name, out / name)
    model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # as a test would load it
    tok = AutoTokenizer.from_pretrained(out)

    prompt_completion_records = [{"prompt": p, "completion": c} for p, c in MODEL_PROMPT_COMPLETION]
    chat_records = [{"messages": [{"role": r, "content": c} for r, c in chat]} for chat in MODEL_CHATS]
    write_jsonl(HERE / "prompt_completion.jsonl", prompt_completion_records)
    write_jsonl(HERE / "chat.jsonl", chat_records)
    tokenized = {"prompt_completion": [prompt_completion(tok, r) for r in prompt_completion_records], "chat": []}
    for record in chat_records:
        rendered = tok.apply_chat_template(record["messages"], tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
        tokenized["chat"].append((rendered["input_ids"], rendered["assistant_masks"]))
    lengths = {"prompt_completion": (8, 40), "chat": (15, 60)}
    losses = {}
    for kind, records in tokenized.items():
        per_record = []
        for ids, mask in records:
            low, high = lengths[kind]
            assert low <= len(ids) <= high and len(mask) == len(ids), (kind, len(ids), tok.decode(ids))
            per_record.append(record_nll(model, ids, mask))
        nll, targets = sum(n for n, _ in per_record), sum(t for _, t in per_record)
        losses[kind] = {"nll": nll, "targets": targets, "mean": nll / targets, "per_record": per_record,
                        "ids": [ids for ids, _ in records], "mask": [mask for _, mask in records]}
        print(f"{kind}: {len(records)} records, {targets} targets, mean loss {nll / targets!r}")
    write_json(HERE / "model_losses.json", losses, depth=3)  # one record a line
    print(f"{out}: {sorted(p.name for p in out.iterdir())}, {sum(p.stat().st_size for p in out.iterdir())} bytes")


def record_nll(model, ids: list, mask: list) -> list:
    """[summed NLL, targets] of one record alone (batch 1, no padding): labels are the ids
    where the mask is 1, else -100, and logits[i] predicts labels[i + 1], as transformers
    shifts them; the sum in float64 from the float32 logits, checked against the mean
    transformers returns."""
    import torch

    input_ids = torch.tensor([ids])
    labels = torch.where(torch.tensor([mask]) == 1, input_ids, -100)
    with torch.no_grad():
        out = model(input_ids, labels=labels)
    assert out.logits.dtype == torch.float32
    logp = out.logits[0, :-1].double().log_softmax(-1)
    shifted = labels[0, 1:]
    kept = shifted != -100
    targets = int(kept.sum())
    assert targets > 0, ids
    nll = float(-logp[kept].gather(-1, shifted[kept][:, None]).sum())
    assert abs(nll / targets - float(out.loss)) <= 1e-6 * abs(float(out.loss)), (nll / targets, float(out.loss))
    return [nll, targets]


def main() -> None:
    tokenizers = {}
    for name, make in (("chatml", make_chatml), ("llama", make_llama)):
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        make(out)
        tok = AutoTokenizer.from_pretrained(out)
        # What the tests check besides the records: the special tokens transformers names
        # (and their ids: <|pad|> is added past the vocabulary) and the template's variables.
        tokenizers[name] = {
            "vocab": len(tok), "special_tokens": tok.special_tokens_map,
            "ids": {t: tok.convert_tokens_to_ids(t) for t in tok.special_tokens_map.values()},
            "records": goldens(name, reference=LLAMA_GENERATION if name == "llama" else None)}
        print(f"{out}: {sorted(p.name for p in out.iterdir())}, {len(tok)} tokens, "
              f"special {tok.special_tokens_map}, {len(tokenizers[name]['records'])} records")
    tokenizers["llama-trim"] = {"directory": "llama", "chat_template": LLAMA_TRIM_PLAIN,
                                "records": goldens("llama", LLAMA_TRIM_PLAIN, LLAMA_TRIM_GENERATION)}
    tokenizers.update(published_template_goldens())
    write_json(HERE / "goldens.json", tokenizers, depth=3)  # one record a line
    make_model()


def check_trl() -> None:
    """The goldens' TRL rules against TRL's own SFTTrainer (its dataset preparation: the
    tokenized dataset's input_ids and labels). TRL is no test dependency; with pip:

        pip install --target DIR --no-deps trl accelerate datasets dill xxhash multiprocess pyarrow pandas \\
            psutil python-dateutil six tzdata pytz
        PYTHONPATH=DIR python tests/sft/make_goldens.py --check-trl
    """
    import secrets

    import datasets.arrow_dataset
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    # A dataset's fingerprint (a cache key) pickles its arrow table, which fails with some
    # pyarrow and Python versions; nothing here is cached.
    datasets.arrow_dataset.generate_fingerprint = lambda dataset: secrets.token_hex(8)
    golden = json.loads((HERE / "goldens.json").read_text())
    for name in ("chatml", "llama", "qwen2.5", "qwen3"):
        tok = AutoTokenizer.from_pretrained(HERE / golden[name].get("directory", name))
        if "chat_template" in golden[name]:  # a published template, which TRL swaps for its training one
            tok.chat_template = golden[name]["chat_template"]
        model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32)).to(torch.float32)
        records = golden[name]["records"]
        groups = {}
        for i, r in enumerate(records):
            kind = ("messages" if "messages" in r["record"] else "text" if "text" in r["record"] else
                    "conversational" if isinstance(r["record"]["prompt"], list) else "prompt")
            groups.setdefault(kind, []).append(i)
        for kind, indices in groups.items():
            if kind == "messages" and name == "llama":
                continue  # a template without generation blocks: TRL has no assistant mask for it
            # Tools as JSON text, as TRL's datasets hold them (Arrow has no empty struct for "properties": {}),
            # in every row (from_list takes the first row's columns).
            rows = [{**records[i]["record"], "tools": json.dumps(records[i]["record"]["tools"])
                     if "tools" in records[i]["record"] else None} for i in indices]
            with tempfile.TemporaryDirectory() as out:
                args = SFTConfig(output_dir=out, report_to=[], assistant_only_loss=kind == "messages",
                                 max_length=None, bf16=False, use_cpu=True)
                trainer = SFTTrainer(model=model, args=args, processing_class=tok,
                                     train_dataset=Dataset.from_list(rows))
            for i, row in zip(indices, trainer.train_dataset):
                mask = row.get("assistant_masks", row.get("completion_mask", [1] * len(row["input_ids"])))
                labels = row.get("labels")
                if labels is not None:
                    mask = [int(label != -100) for label in labels]
                assert row["input_ids"] == records[i]["input_ids"], (name, i, row["input_ids"], records[i])
                assert mask == records[i]["loss"], (name, i, mask, records[i])
            print(f"{name} {kind}: {len(indices)} records as TRL {__import__('trl').__version__} makes them")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check-trl", action="store_true", help="check goldens.json against TRL's SFTTrainer")
    if parser.parse_args().check_trl:
        check_trl()
    else:
        main()
