"""Models written for one device, and their named presets."""

from models.llama import Llama, LlamaConfig

PRESETS: dict[str, LlamaConfig] = {
    # For tests and the CPU demo: every dimension divides 2, 4 and 8.
    "tiny": LlamaConfig(vocab=256, embed=64, layers=2, heads=8, kv_heads=4, head_dim=8, mlp=192),
    # For CPU benchmarks: large enough that a step is not dominated by overhead.
    "small": LlamaConfig(vocab=256, embed=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=768),
    "llama3.2-1b": LlamaConfig(
        vocab=128256, embed=2048, layers=16, heads=32, kv_heads=8, head_dim=64, mlp=8192,
        rope_theta=500_000.0, tie_embeddings=True,
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
}

__all__ = ["Llama", "LlamaConfig", "PRESETS"]
