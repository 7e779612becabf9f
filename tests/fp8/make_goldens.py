"""Make the FP8 goldens tests/test_fp8.py checks spmd's `--fp8 tensorwise|rowwise` against
(run by hand in a venv with torch, transformers and torchao 0.18, which the tests do not need):

    pip install torch transformers torchao==0.18.* && python tests/fp8/make_goldens.py

- linear.npz: one linear layer of torchao's `Float8Linear` in each recipe, in float32: its
  input x (tokens, in), weight w (torch's (out, in)) and output gradient g, and what torchao
  gives for y, dx and dw (`<recipe>/y` ...).
- training: the llama-gqa golden of tests/hf (2 layers, 32 wide) trained STEPS steps by
  transformers with torchao's `convert_to_float8_training` under each recipe, every linear
  layer of the blocks converted and the head not (spmd keeps the head in its own precision,
  as DeepSeek-V3 and torchtitan do), in float32, with plain SGD (lr LR, no clipping) so
  that only the matmuls differ between the two trainers. The batches are tokens.npy (steps,
  batch, seq + 1): each step's inputs are all but the last token of each row, its targets
  the rows shifted by one, the loss their mean cross-entropy. goldens.json holds each
  recipe's loss and gradient norm (of every parameter, before the step's update) per step,
  and those of the same training without FP8; <recipe>.safetensors the weights after each
  step (Hugging Face names prefixed by `step<N>/`), so that a test can also start a step
  from the golden's own weights.
"""

import json
from pathlib import Path

import numpy as np
import torch
import torchao
from safetensors.torch import save_file
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from transformers import AutoModelForCausalLM

HERE = Path(__file__).parent
BASE = HERE.parent / "hf" / "llama-gqa"
STEPS, BATCH, SEQ, LR = 5, 4, 32, 0.5
RECIPES = ("tensorwise", "rowwise")


def linear_goldens() -> None:
    """Magnitudes that differ by row, so that rowwise's scales differ; a zero row."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 48)) * np.exp(rng.uniform(-3, 3, (64, 1)))).astype(np.float32)
    x[5] = 0
    w = (rng.standard_normal((80, 48)) * np.exp(rng.uniform(-2, 2, (80, 1)))).astype(np.float32)
    g = (rng.standard_normal((64, 80)) * np.exp(rng.uniform(-3, 3, (64, 1)))).astype(np.float32)
    out = {"x": x, "w": w, "g": g}
    for recipe in RECIPES:
        layer = torch.nn.Sequential(torch.nn.Linear(48, 80, bias=False))
        with torch.no_grad():
            layer[0].weight.copy_(torch.from_numpy(w))
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
        xt = torch.from_numpy(x).requires_grad_()
        y = layer(xt)
        y.backward(torch.from_numpy(g))
        out |= {f"{recipe}/y": y.detach().numpy(), f"{recipe}/dx": xt.grad.numpy(),
                f"{recipe}/dw": layer[0].weight.grad.numpy()}
    np.savez_compressed(HERE / "linear.npz", **out)


def train(recipe: str | None, tokens: np.ndarray) -> dict:
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    if recipe:
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda module, fqn: fqn != "lm_head")
    losses, norms, weights = [], [], {}
    for number, step in enumerate(torch.from_numpy(tokens).long(), 1):
        logits = model(input_ids=step[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), step[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()
        norms.append(float(torch.sqrt(sum(torch.sum(p.grad.double() ** 2) for p in model.parameters()))))
        losses.append(loss.item())
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
        weights |= {f"step{number}/{name}": p.detach().clone().contiguous() for name, p in model.named_parameters()}
    return {"loss": losses, "grad_norm": norms, "weights": weights}


def main() -> None:
    linear_goldens()
    vocab = json.loads((BASE / "config.json").read_text())["vocab_size"]
    tokens = np.random.default_rng(0).integers(0, vocab, (STEPS, BATCH, SEQ + 1)).astype(np.int32)
    np.save(HERE / "tokens.npy", tokens)
    goldens = {"lr": LR, "torch": torch.__version__, "torchao": torchao.__version__}
    for recipe in (None, *RECIPES):
        run = train(recipe, tokens)
        goldens[recipe or "none"] = {"loss": run["loss"], "grad_norm": run["grad_norm"]}
        if recipe:
            save_file(run["weights"], HERE / f"{recipe}.safetensors")
        print(recipe, run["loss"], run["grad_norm"])
    (HERE / "goldens.json").write_text(json.dumps(goldens, indent=1) + "\n")


if __name__ == "__main__":
    main()
