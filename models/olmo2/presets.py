"""The OLMo 2 family's named models: the shapes of the published checkpoints
(allenai/OLMo-2-1124-7B and -13B's config.json: 100,352 tokens, rope base 500,000,
rms_norm_eps 1e-6, a context of 4,096)."""

from models.olmo2.model import Olmo2Config

OLMO2 = dict(vocab=100352, head_dim=128, rope_theta=500_000.0, norm_eps=1e-6)

PRESETS: dict[str, Olmo2Config] = {
    "olmo2-7b": Olmo2Config(embed=4096, layers=32, heads=32, kv_heads=32, mlp=11008, **OLMO2),
    "olmo2-13b": Olmo2Config(embed=5120, layers=40, heads=40, kv_heads=40, mlp=13824, **OLMO2),
}
