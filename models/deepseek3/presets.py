"""DeepSeek's named models: the published shapes, and a small one with every feature for
tests and CPU runs."""

from models.deepseek3.config import DeepSeekV3Config, Yarn
from models.moe import MoEConfig

# DeepSeek-V3: 256 routed experts in 8 groups (a token's 8 chosen among its 4 best groups),
# one shared, sigmoid scores with a selection bias, gates renormalized and scaled by 2.5;
# the sequence-wise balance loss at 0.0001 (the paper's alpha), no z-loss.
V3_YARN = Yarn(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
V3_ROUTING = dict(scoring="sigmoid", normalize_top_k=True, selection_bias=True, balance_loss="sequence",
                  aux_loss_weight=0.0001, z_loss_weight=0.0)

PRESETS: dict[str, DeepSeekV3Config] = {
    # 671B parameters, 37B active per token.
    "deepseek-v3": DeepSeekV3Config(
        vocab=129280, embed=7168, layers=61, heads=128, kv_heads=128, head_dim=192, mlp=18432,
        kv_rank=512, rope_dim=64, v_dim=128, q_rank=1536, dense_layers=3,
        yarn=V3_YARN,
        moe=MoEConfig(experts=256, top_k=8, expert_mlp=2048, shared_experts=1, groups=8, top_groups=4, scale=2.5,
                      **V3_ROUTING)),
    # DeepSeek-V2-Lite (15.7B, 2.4B active): queries without a rank of their own, softmax
    # scores over 64 experts, top-6 not renormalized, 2 shared, one dense layer.
    "deepseek-v2-lite": DeepSeekV3Config(
        vocab=102400, embed=2048, layers=27, heads=16, kv_heads=16, head_dim=192, mlp=10944,
        kv_rank=512, rope_dim=64, v_dim=128, q_rank=None, dense_layers=1,
        yarn=Yarn(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, mscale=0.707,
                  mscale_all_dim=0.707),
        moe=MoEConfig(experts=64, top_k=6, expert_mlp=1408, shared_experts=2, scoring="softmax",
                      normalize_top_k=False, aux_loss_weight=0.001, z_loss_weight=0.0)),
    # V3's architecture at 1/7 of its width, for planning its parallel layout on emulated
    # devices: 3 dense layers, then 16 MoE layers of 64 experts in 8 groups (4 kept), top-8.
    "deepseek-v3-small": DeepSeekV3Config(
        vocab=32768, embed=1024, layers=19, heads=16, kv_heads=16, head_dim=96, mlp=2816,
        kv_rank=128, rope_dim=32, v_dim=64, q_rank=384, dense_layers=3,
        yarn=V3_YARN,
        moe=MoEConfig(experts=64, top_k=8, expert_mlp=256, shared_experts=1, groups=8, top_groups=4, scale=2.5,
                      **V3_ROUTING)),
    # V3's architecture at test size: 2 dense layers, then 4 MoE layers of 16 experts in 4
    # groups (2 kept), top-4, a shared expert, YaRN; every dimension divides 2, 4 and 8.
    "deepseek-v3-tiny": DeepSeekV3Config(
        vocab=256, embed=64, layers=6, heads=8, kv_heads=8, head_dim=16, mlp=192,
        kv_rank=32, rope_dim=8, v_dim=8, q_rank=48, dense_layers=2,
        yarn=Yarn(factor=4.0, original_max_position=64, mscale=1.0, mscale_all_dim=1.0),
        moe=MoEConfig(experts=16, top_k=4, expert_mlp=32, shared_experts=1, groups=4, top_groups=2, scale=2.5,
                      **V3_ROUTING)),
}
