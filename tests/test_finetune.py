"""Fine-tuning as people do it, against transformers: the records of tests/sft tokenize to
transformers' ids and masks, spmd.eval's loss over their targets is transformers' on any
mesh, and a fine-tuning run on chat records lowers that loss, exports, and answers with
the chat template applied. The goldens come from tests/sft/make_goldens.py (torch and
transformers, not needed here)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from support.commands import one_error_line

from spmd.config import TrainConfig, validate
from spmd.data.index import read_examples
from spmd.data.tokenizer import load_tokenizer_directory
from spmd.formats.hf import companions
from spmd.inference.evaluation import evaluate

SFT = Path(__file__).parent / "sft"
MODEL = SFT / "model"
GOLDEN = json.loads((SFT / "model_losses.json").read_text())
DRIVER = Path(__file__).with_name("cli_driver.py")
FILES = {"prompt_completion": SFT / "prompt_completion.jsonl", "chat": SFT / "chat.jsonl"}


@pytest.mark.parametrize("name", FILES)
def test_records_tokenize_as_transformers_does(name):
    examples = read_examples(str(FILES[name]), load_tokenizer_directory(str(MODEL)))
    golden = GOLDEN[name]
    assert [e.ids.tolist() for e in examples] == golden["ids"]
    # transformers' mask marks the tokens the labels keep; ours, the same tokens as targets.
    assert [e.loss.astype(int).tolist() for e in examples] == golden["mask"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    """prompt_completion.jsonl packed once by `python -m spmd.corpus --seq 64`."""
    out = tmp_path_factory.mktemp("packed") / "prompt_completion.npy"
    case = {"module": "spmd.corpus", "argv": ["--data", str(FILES["prompt_completion"]), "--tokenizer", str(MODEL),
                                              "--seq", "64", "--out", str(out)], "cwd": str(out.parent)}
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps([case]), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)[0]
    assert result["code"] == 0 and f"({GOLDEN['prompt_completion']['targets']:,} target tokens;" in result["stdout"], \
        result
    return out


@pytest.mark.parametrize("name, mesh", [  # the gate keeps one: chat on a mesh
    pytest.param("prompt_completion", "", marks=pytest.mark.slow),
    pytest.param("prompt_completion", "fsdp=2,tp=2", marks=pytest.mark.slow),
    pytest.param("prompt_completion", "sp=2", marks=pytest.mark.slow), ("chat", "dp=2,tp=2"),
    pytest.param("pre-packed prompt_completion", "dp=2", marks=pytest.mark.slow)])
def test_eval_is_transformers_mean_loss_over_the_targets(name, mesh, request):
    # float32 throughout on both sides; the sums differ in order only: 1e-5 relative.
    data = request.getfixturevalue("packed") if name.startswith("pre-packed") else FILES[name]
    name = name.removeprefix("pre-packed ")
    cfg = validate(TrainConfig.of(init_from=str(MODEL), data=str(data), mesh=mesh, batch=4, seq=64))
    loss, targets, _ = evaluate(cfg, None, None, jax.devices()[:cfg.parallelism.mesh_spec.devices])
    assert targets == GOLDEN[name]["targets"]
    np.testing.assert_allclose(loss, GOLDEN[name]["mean"], rtol=1e-5)


def test_a_chat_fine_tune_lowers_the_loss_exports_and_answers_with_the_template(tmp_path):
    """Twelve conversations, memorized on dp=2,fsdp=2,tp=2: the exported model, prompted
    through the chat template, answers with what it was trained on (a prompt rendered
    otherwise than in training would not bring the answer back)."""
    shutil.copytree(MODEL, tmp_path / "model")
    shutil.copy(FILES["chat"], tmp_path / "chat.jsonl")
    questions = {"What is 2 + 2?": "4.", "Name a fruit.": "An apple.", "Capital of Peru?": "Lima."}
    commands = [
        ("spmd.train", "--init-from model --data chat.jsonl --mesh dp=2,fsdp=2,tp=2 --steps 60 --seq 64 --batch 8 "
                       "--lr 1e-2 --warmup 5 --out run"),
        ("spmd.export", "--checkpoint run --format hf --out exported"),
        ("spmd.eval", "--init-from exported --data chat.jsonl --seq 64 --batch 4"),
        ("spmd.generate", "--init-from exported --chat --max-new-tokens 8 --output answers.jsonl"),
    ]
    cases = [{"module": module, "argv": argv.split(), "cwd": str(tmp_path)} for module, argv in commands]
    for question in questions:
        cases[-1]["argv"] += ["--prompt", question]
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout)
    for (module, _), result in zip(commands, results):
        assert result["code"] == 0, f"{module}: {result['stderr'][-2000:]}"
    trained = float(re.search(r"loss ([0-9.]+) nats/token", results[2]["stdout"]).group(1))
    assert trained < 0.1 < GOLDEN["chat"]["mean"]
    answers = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    for record, (question, answer) in zip(answers, questions.items()):
        assert record["completion"].startswith(answer), (question, record["completion"])
    assert (tmp_path / "exported" / "tokenizer_config.json").is_file()  # the chat template goes with the model


def test_bad_records_give_one_error_line_and_exit_2(tmp_path):
    plain = tmp_path / "plain"  # the model's tokenizer without its chat template
    plain.mkdir()
    shutil.copy(MODEL / "tokenizer.json", plain)
    config = json.loads((MODEL / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    files = {
        "no known fields": ([{"question": "a", "answer": "b"}], "line 1: no text field 'text' (--text-field), nor "
                                                                "the fields of a fine-tuning record"),
        "unknown role": ([{"messages": [{"role": "bot", "content": "hi"}, *chat]}],
                         "line 1: messages[0] has role 'bot'"),
        "no assistant turn": ([{"messages": chat[:1]}], "line 1: messages have no assistant turn"),
        "no chat template": ([{"messages": chat}], "has none (chat_template.jinja"),
        "nothing to train on": ([{"prompt": "word " * 80, "completion": "end"}], "no target tokens"),
    }
    cases = []
    for name, (records, _) in files.items():
        path = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        argv = ["--init-from", str(MODEL), "--data", str(path), "--mesh", "dp=1", "--steps", "1", "--seq", "32",
                "--batch", "1"] + (["--tokenizer", str(plain)] if name == "no chat template" else [])
        cases.append({"module": "spmd.train", "argv": argv, "cwd": str(tmp_path)})
    # Packing once with spmd.corpus needs the rows' length, and is for records only.
    (tmp_path / "text.txt").write_text("some text")
    corpus = {"records without --seq": (["--data", str(FILES["chat"]), "--tokenizer", str(MODEL), "--out", "p.npy"],
                                        "chat.jsonl holds fine-tuning records: give --seq"),
              "text with --seq": (["--data", "text.txt", "--seq", "64", "--out", "p.npy"],
                                  "--seq packs fine-tuning records; --data text.txt holds text")}
    files |= {name: (None, fragment) for name, (_, fragment) in corpus.items()}
    cases += [{"module": "spmd.corpus", "argv": argv, "cwd": str(tmp_path)} for argv, _ in corpus.values()]
    done = subprocess.run([sys.executable, str(DRIVER)], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not (tmp_path / "p.npy").exists()
    for (name, (_, fragment)), result in zip(files.items(), json.loads(done.stdout)):
        assert result["code"] == 2, (name, result["stderr"][-1000:])
        line = one_error_line(result["stderr"])
        assert fragment in line and (".jsonl" in line or "text.txt" in line), (name, line)


def test_a_chat_template_file_goes_with_the_model():
    # transformers 5 keeps a model's template in chat_template.jinja: an export copies it with the tokenizer.
    found = companions(SFT / "llama", "--init-from")
    assert found["chat_template.jinja"] == SFT / "llama" / "chat_template.jinja"
    assert "tokenizer.json" in found
