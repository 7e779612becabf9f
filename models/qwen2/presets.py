"""The Qwen2 family's named models: the shapes of the published checkpoints."""

from models.qwen2.model import Qwen2Config

PRESETS: dict[str, Qwen2Config] = {
    "qwen2.5-7b": Qwen2Config(vocab=152064, embed=3584, layers=28, heads=28, kv_heads=4, head_dim=128, mlp=18944,
                              rope_theta=1_000_000.0, norm_eps=1e-6),
}
