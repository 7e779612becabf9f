"""Make the LoRA goldens the tests read (run by hand; needs torch, transformers and peft,
which the tests do not, and spmd's own environment for spmd's side):

    pip install torch transformers peft
    python tests/hf/make_lora_goldens.py --spmd-python .venv/bin/python

Both adapters sit on the llama-gqa golden (make_goldens.py) and adapt all seven projections.

- lora-peft/: an adapter made by peft (r 4, alpha 8), its A and B drawn at random (a fresh
  adapter's B is zeros, which would show nothing), saved by `save_pretrained`; with the
  logits of peft's model for the golden's tokens (logits.npy) and the weights of
  `merge_and_unload()` (merged.safetensors).
- lora-spmd/: an adapter trained by spmd (`python -m spmd.train --lora-rank 4`, 6 steps on
  fsdp=2,tp=2) and exported with `spmd.export --format peft`, with spmd's logits for the
  golden's tokens (spmd-logits.npy). Here peft loads it (`PeftModel.from_pretrained`) and
  its logits are compared with spmd's: peft-check.json records the largest difference,
  which a test reads (and checks spmd's logits are still those).
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import peft
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = Path(__file__).parent
BASE = HERE / "llama-gqa"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8
TOLERANCE = 1e-4  # the issue's: float32 logits of two implementations, summed in other orders


def base_model():
    return AutoModelForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32).eval()


def logits_of(model) -> np.ndarray:
    tokens = torch.from_numpy(np.load(BASE / "tokens.npy")).long()
    with torch.no_grad():
        return model(tokens).logits.float().numpy()


def make_peft_adapter() -> None:
    out = HERE / "lora-peft"
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(0)
    model = get_peft_model(base_model(), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS,
                                                    lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.peft_config["default"].base_model_name_or_path = "tests/hf/llama-gqa"  # not this machine's path
    model.save_pretrained(out)
    np.save(out / "logits.npy", logits_of(model))
    merged = model.merge_and_unload()
    save_file({k: v.contiguous() for k, v in merged.state_dict().items()}, out / "merged.safetensors")
    print(f"{out}: {sorted(p.name for p in out.iterdir())}")


def make_spmd_adapter(spmd_python: str) -> None:
    out = HERE / "lora-spmd"
    shutil.rmtree(out, ignore_errors=True)
    root = HERE.parent.parent
    base = str(BASE.relative_to(root))  # as the adapter records it: not this machine's path
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        common = dict(cwd=root, check=True)
        subprocess.run([spmd_python, "-m", "spmd.train", "--init-from", base, "--lora-rank", str(RANK),
                        "--lora-alpha", str(ALPHA), "--lora-targets", ",".join(TARGETS), "--mesh", "fsdp=2,tp=2",
                        "--steps", "6", "--batch", "8", "--seq", "32", "--lr", "3e-2", "--warmup", "0",
                        "--out", str(run)], **common)
        subprocess.run([spmd_python, "-m", "spmd.export", "--checkpoint", str(run), "--format", "peft",
                        "--out", str(out)], **common)
    subprocess.run([spmd_python, "-c", (
        "import sys, numpy as np\n"
        "from spmd.hf import from_pretrained\n"
        "base, adapter = sys.argv[1:3]\n"
        "model = from_pretrained(base, adapter=adapter)\n"
        "np.save(sys.argv[3], np.asarray(model(np.load(base + '/tokens.npy'))))\n"),
        base, str(out), str(out / "spmd-logits.npy")], cwd=root, check=True)
    model = PeftModel.from_pretrained(base_model(), out).eval()
    diff = float(np.max(np.abs(logits_of(model) - np.load(out / "spmd-logits.npy"))))
    check = {"max_abs_logit_diff": diff, "tolerance": TOLERANCE, "peft": peft.__version__,
             "transformers": transformers.__version__, "torch": torch.__version__}
    (out / "peft-check.json").write_text(json.dumps(check, indent=1) + "\n")
    print(f"{out}: peft's logits differ from spmd's by at most {diff:.2e}")
    if diff > TOLERANCE:
        sys.exit(f"error: more than {TOLERANCE}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--spmd-python", required=True, help="a Python with spmd installed (and JAX)")
    args = parser.parse_args()
    make_peft_adapter()
    make_spmd_adapter(args.spmd_python)
