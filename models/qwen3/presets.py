"""The Qwen3 family's named models: the shapes of the published checkpoints."""

from models.moe import MoEConfig
from models.qwen3.model import Qwen3Config

QWEN3 = dict(vocab=151936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6)
# Qwen3-MoE: 128 experts, top-8 renormalized, MoE in every layer (intermediate_size, the
# dense width, is published but unused), trained with transformers' pooled balance loss.
QWEN3_MOE = dict(experts=128, top_k=8, balance_loss="pooled", aux_loss_weight=0.001, z_loss_weight=0.0)

PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(embed=1024, layers=28, heads=16, kv_heads=8, mlp=3072, tie_embeddings=True, **QWEN3),
    "qwen3-8b": Qwen3Config(embed=4096, layers=36, heads=32, kv_heads=8, mlp=12288, **QWEN3),
    "qwen3-32b": Qwen3Config(embed=5120, layers=64, heads=64, kv_heads=8, mlp=25600, **QWEN3),
    "qwen3-30b-a3b": Qwen3Config(embed=2048, layers=48, heads=32, kv_heads=4, mlp=6144,
                                 moe=MoEConfig(expert_mlp=768, **QWEN3_MOE), **QWEN3),
    "qwen3-235b-a22b": Qwen3Config(embed=4096, layers=94, heads=64, kv_heads=4, mlp=12288,
                                   moe=MoEConfig(expert_mlp=1536, **QWEN3_MOE), **QWEN3),
}
