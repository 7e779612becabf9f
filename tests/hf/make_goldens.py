"""Make the Hugging Face golden models the tests load (run by hand; needs torch and
transformers, which the tests do not):

    pip install torch transformers && python tests/hf/make_goldens.py [--router-losses] [NAME ...]

Each golden is a small random model saved by transformers in float32, with the tokens
(tokens.npy) and the logits transformers computes for them (logits.npy). A model is
small enough to commit (tens of kB) and has every feature the loader reads: GQA, a
sharded checkpoint with its index, tied embeddings with Llama 3.1 rope scaling (set so
that all three frequency bands occur within the sequence), a Mixtral MoE, a Qwen3 (query
and key norms, its own head size, tied), a Qwen2 (q/k/v biases), a Mistral (a sliding
window), two Qwen3-MoEs (dense and MoE layers: every other one, and at the
layers mlp_only_layers lists), a Gemma 3 (sliding and global layers), an OLMo 2 (norms after each sublayer,
q/k norms over the whole projections) and two
DeepSeek-V3s (latent attention with and without a query rank, a dense prefix, grouped
routing with a selection bias, YaRN).

    python tests/hf/make_goldens.py --check DIR GOLDEN

loads an exported directory DIR with transformers and prints its largest logit
difference from GOLDEN's reference logits (for a closing note; no test needs torch).
"""

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Olmo2Config, Olmo2ForCausalLM,
                          MistralConfig, MistralForCausalLM,
                          MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

HERE = Path(__file__).parent
SHAPE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, intermediate_size=64, max_position_embeddings=256)
DEEPSEEK = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
                routed_scaling_factor=2.5, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}
GOLDENS = {
    # Saved in shards (max 20 kB each) with model.safetensors.index.json, and a BPE tokenizer.
    "llama-gqa": (LlamaForCausalLM, LlamaConfig(**SHAPE, rope_theta=10000.0, tie_word_embeddings=False), "20kB"),
    # original_max_position_embeddings 64: with head_dim 16, wavelengths 6.3 (kept), 32
    # (blended) and 166 and up (slowed) all occur.
    "llama-tied-rope": (LlamaForCausalLM, LlamaConfig(
        **(SHAPE | dict(head_dim=16)), rope_theta=500000.0,
        tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        None),
    "mixtral": (MixtralForCausalLM, MixtralConfig(**(SHAPE | dict(intermediate_size=32)), num_local_experts=4,
                                                  num_experts_per_tok=2, rope_theta=1000000.0), None),
    # Query and key norms; a head size that is not hidden / heads (16, not 8); tied, as the small Qwen3s.
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**(SHAPE | dict(head_dim=16)), rope_theta=1000000.0,
                                            tie_word_embeddings=True), None),
    # Biases on q, k and v (not o); tied, as the small Qwen2.5s.
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**{k: v for k, v in SHAPE.items() if k != "head_dim"},
                                            rope_theta=1000000.0, tie_word_embeddings=True), None),
    # A window of 6: shorter than the sequence and than an sp chunk (64 tokens over sp=4: 8).
    "mistral": (MistralForCausalLM, MistralConfig(**SHAPE, sliding_window=6), None),
    # A dense layer, then an MoE one (decoder_sparse_step 2) with experts narrower than the
    # dense MLP; top-k weights not renormalized (Mixtral's are).
    "qwen3-moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**SHAPE, moe_intermediate_size=32, num_experts=4,
                                                     num_experts_per_tok=2, decoder_sparse_step=2,
                                                     norm_topk_prob=False, rope_theta=1000000.0), None),
    # Dense layers among MoE ones (mlp_only_layers): dense, MoE, dense, MoE; top-k renormalized.
    "qwen3-moe-dense": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **(SHAPE | dict(num_hidden_layers=4)), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[0, 2], norm_topk_prob=True, rope_theta=1000000.0), None),
    # Sliding, sliding, global, sliding (pattern 3: pipeline stages of 2 layers hold
    # different kinds); a window of 6; linear rope scaling on the global layer; a query
    # scale that is not the head size.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(
        **(SHAPE | dict(num_hidden_layers=4)), sliding_window=6, sliding_window_pattern=3, query_pre_attn_scalar=12,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), None),
    # Norms after attention and the MLP, none before; q/k norms over the whole projections
    # (4 x 8 and 2 x 8: tp=4 on the mesh test goes beyond the 2 kv heads); untied.
    "olmo2": (Olmo2ForCausalLM, Olmo2Config(**SHAPE, rms_norm_eps=1e-6,
                                            rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), None),
    # Latent attention with a low-rank query; 2 dense layers, then 2 MoE layers of 8
    # experts in 4 groups (2 kept) with a shared expert; YaRN whose attention factor is not
    # 1 (mscale differs from mscale_all_dim), so both the rotation's and the softmax's
    # scales are exercised. max_position_embeddings = factor x original, so transformers'
    # versions that derive the factor agree with those that read it.
    "deepseek-v3": (DeepseekV3ForCausalLM, DeepseekV3Config(**DEEPSEEK, q_lora_rank=24, num_hidden_layers=4,
                                                            first_k_dense_replace=2, n_group=4, topk_group=2,
                                                            max_position_embeddings=256, rope_parameters=YARN), None),
    # A plain query projection (q_lora_rank null), one dense layer, 2 groups of which 1 is
    # kept, gates not renormalized, no rope scaling.
    "deepseek-v3-q": (DeepseekV3ForCausalLM, DeepseekV3Config(
        **(DEEPSEEK | dict(routed_scaling_factor=1.0)), q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1,
        norm_topk_prob=False, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), None),
}
BATCH, SEQ = 2, 64
PROMPTS, GENERATED = (1, 7, 20), 24
TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
        "all that glitters is not gold. the early bird catches the worm. ") * 20


def make(name: str) -> None:
    cls, config, shard = GOLDENS[name]
    torch.manual_seed(sum(map(ord, name)))
    model = cls(config).float().eval()
    with torch.no_grad():  # larger weights than the 0.02 default, so that layers matter to the logits
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.uniform_(0.5, 1.5)
        for name_, buffer in model.named_buffers():  # DeepSeek's selection bias: large enough to change choices
            if name_.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (BATCH, SEQ)).astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    np.save(out / "tokens.npy", tokens)
    np.save(out / "logits.npy", logits)
    # Greedy continuations of prompts of three lengths: GENERATED tokens each (no end-of-text
    # token, which would stop early or, with min_new_tokens, be suppressed).
    model.generation_config.eos_token_id = None
    for length in PROMPTS:
        with torch.no_grad():
            ids = model.generate(torch.from_numpy(tokens[:, :length]).long(), do_sample=False,
                                 max_new_tokens=GENERATED, pad_token_id=0)
        assert ids.shape[1] == length + GENERATED
        np.save(out / f"greedy-{length}.npy", ids[:, length:].numpy().astype(np.int32))
    if name == "llama-gqa":
        make_tokenizer(out, config.vocab_size - 8)
    print(f"{out}: {sorted(p.name for p in out.iterdir())}")


def make_tokenizer(out: Path, size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=size, special_tokens=["<unk>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60]))
    tok.save(str(out / "tokenizer.json"))


def router_losses(name: str = "mixtral") -> None:
    """A MoE golden's losses as transformers trains it (output_router_logits on): the
    next-token cross-entropy of tokens[:, 1:] after tokens[:, :-1] and the load-balancing
    loss of that forward pass (load_balancing_loss_func, pooled over the batch and every
    layer), into router_losses.json."""
    import json

    model = AutoModelForCausalLM.from_pretrained(HERE / name, torch_dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(HERE / name / "tokens.npy")).long()
    with torch.no_grad():
        out = model(tokens[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), tokens[:, 1:].reshape(-1))
    losses = {"cross_entropy": float(ce), "aux_loss": float(out.aux_loss),
              "router_aux_loss_coef": model.config.router_aux_loss_coef}
    (HERE / name / "router_losses.json").write_text(json.dumps(losses, indent=1) + "\n")
    print(f"{name}: {losses}")


def check(directory: str, golden: str) -> float:
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    tokens = np.load(HERE / golden / "tokens.npy")
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
    diff = float(np.max(np.abs(logits - np.load(HERE / golden / "logits.npy"))))
    print(f"{directory}: transformers loads it; max |logits - {golden}'s reference| = {diff:.2e}")
    return diff


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", nargs=2, metavar=("DIR", "GOLDEN"))
    parser.add_argument("--router-losses", action="store_true", help="only remake mixtral/router_losses.json")
    parser.add_argument("names", nargs="*", choices=[[], *GOLDENS], help="only these goldens (default: all)")
    args = parser.parse_args()
    if args.router_losses:
        sys.exit(router_losses())
    if args.check:
        sys.exit(0 if check(*args.check) < 1e-4 else 1)
    for name in args.names or GOLDENS:
        make(name)
    if not args.names or "mixtral" in args.names:
        router_losses()
