"""The Mistral family: Llama's module with a sliding window over every layer's attention
(`model`), its Hugging Face layout (`hf`), its named shapes (`presets`)."""

from models.mistral import hf
from models.mistral.model import Mistral, MistralConfig
from models.mistral.presets import PRESETS

__all__ = ["PRESETS", "Mistral", "MistralConfig", "hf"]
