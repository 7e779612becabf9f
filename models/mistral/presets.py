"""The Mistral family's named models: the shapes of the published checkpoints."""

from models.mistral.model import MistralConfig

MISTRAL_7B = dict(embed=4096, layers=32, heads=32, kv_heads=8, head_dim=128, mlp=14336)

PRESETS: dict[str, MistralConfig] = {
    # v0.1: a 4096-token window in every layer.
    "mistral-7b": MistralConfig(vocab=32000, window=4096, **MISTRAL_7B),
    # v0.3 (the one fine-tuned today): a larger vocabulary, no window, rope_theta 1e6.
    "mistral-7b-v0.3": MistralConfig(vocab=32768, rope_theta=1_000_000.0, **MISTRAL_7B),
}
