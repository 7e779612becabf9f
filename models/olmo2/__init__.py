"""The OLMo 2 family: Llama's module with norms after each sublayer and q/k norms over the
whole projections (`model`), its Hugging Face layout (`hf`), its named shapes (`presets`)."""

from models.olmo2 import hf
from models.olmo2.model import Olmo2, Olmo2Config
from models.olmo2.presets import PRESETS

__all__ = ["PRESETS", "Olmo2", "Olmo2Config", "hf"]
