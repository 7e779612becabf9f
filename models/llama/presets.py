"""The Llama family's named models: shapes of published checkpoints, and small ones for
tests, CPU demos and planning."""

from models.llama.config import LlamaConfig, RopeScaling
from models.moe import MoEConfig

# The published configs' rope_scaling (Llama 3.2 slows the long waves by 32, not 8).
LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)

PRESETS: dict[str, LlamaConfig] = {
    # For tests and the CPU demo: every dimension divides 2, 4 and 8.
    "tiny": LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=4, head_dim=8, mlp=192),
    # For CPU benchmarks: large enough that a step is not dominated by overhead.
    "small": LlamaConfig(vocab=256, embed=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=768),
    "llama3.2-1b": LlamaConfig(
        vocab=128256, embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192,
        rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING.with_factor(32.0), tie_embeddings=True,
    ),
    "llama3.2-3b": LlamaConfig(
        vocab=128256, embed=3072, layers=28, heads=24, kv_heads=8, head_dim=128, mlp=8192,
        rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING.with_factor(32.0), tie_embeddings=True,
    ),
    "llama2-7b": LlamaConfig(
        vocab=32000, embed=4096, layers=32, heads=32, kv_heads=32, head_dim=128, mlp=11008,
    ),
    "llama3-8b": LlamaConfig(
        vocab=128256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336,
        rope_theta=500_000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab=128256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672,
        rope_theta=500_000.0,
    ),
    "llama3.1-8b": LlamaConfig(
        vocab=128256, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336,
        rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "llama3.1-70b": LlamaConfig(
        vocab=128256, embed=8192, layers=80, heads=64, kv_heads=8, head_dim=128, mlp=28672,
        rope_theta=500_000.0, rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    # Mixture of experts. For tests: 8 experts, top-2, a shared expert, MoE in every
    # second layer (one dense block, then one MoE block).
    "moe-tiny": LlamaConfig(
        vocab=256, embed=64, layers=2, heads=8, kv_heads=4, head_dim=8, mlp=192,
        moe=MoEConfig(experts=8, top_k=2, expert_mlp=64, shared_experts=1, every=2),
    ),
    # Mixtral 8x7B's shapes: 8 experts of width 14336, top-2, in every layer.
    "mixtral-8x7b": LlamaConfig(
        vocab=32000, embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336,
        rope_theta=1_000_000.0, moe=MoEConfig(experts=8, top_k=2, expert_mlp=14336),
    ),
    # Fine-grained experts after DeepSeekMoE 16B (64 narrow experts, top-6, 2 shared) with
    # DeepSeek-V3's sigmoid scoring; standard grouped-query attention instead of MLA, and
    # every layer MoE (DeepSeek keeps its first layer dense).
    "deepseek-moe-16b-like": LlamaConfig(
        vocab=102400, embed=2048, layers=28, heads=16, kv_heads=16, head_dim=128, mlp=10944,
        moe=MoEConfig(experts=64, top_k=6, expert_mlp=1408, shared_experts=2, scoring="sigmoid"),
    ),
}
