"""The Qwen3 family's named models (dense): the shapes of the published checkpoints."""

from models.qwen3.model import Qwen3Config

QWEN3 = dict(vocab=151936, head_dim=128, kv_heads=8, rope_theta=1_000_000.0, norm_eps=1e-6)

PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(embed=1024, layers=28, heads=16, mlp=3072, tie_embeddings=True, **QWEN3),
    "qwen3-8b": Qwen3Config(embed=4096, layers=36, heads=32, mlp=12288, **QWEN3),
    "qwen3-32b": Qwen3Config(embed=5120, layers=64, heads=64, mlp=25600, **QWEN3),
}
