"""The Gemma 3 family's named models (text): the shapes of the published checkpoints."""

from models.gemma3.model import Gemma3Config, layer_types

GEMMA3 = dict(vocab=262144, rope_theta=1_000_000.0, local_rope_theta=10_000.0)

PRESETS: dict[str, Gemma3Config] = {
    "gemma3-1b": Gemma3Config(embed=1152, layers=26, heads=4, kv_heads=1, head_dim=256, mlp=6912, window=512,
                              layer_types=layer_types(26), query_scale=256.0, **GEMMA3),
    # The text model of the 27B checkpoint (its vision tower and projector are not ours);
    # linear rope scaling of 8 on the global layers.
    "gemma3-27b": Gemma3Config(**(GEMMA3 | dict(vocab=262208)), embed=5376, layers=62, heads=32, kv_heads=16,
                               head_dim=128, mlp=21504, window=1024, layer_types=layer_types(62), query_scale=168.0,
                               rope_linear_factor=8.0),
}
