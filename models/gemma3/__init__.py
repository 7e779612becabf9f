"""The Gemma 3 family (text): its config and its parts over Llama's (`model`),
its Hugging Face layout (`hf`), its named shapes (`presets`)."""

from models.gemma3 import hf
from models.gemma3.model import Gemma3, Gemma3Config
from models.gemma3.presets import PRESETS

__all__ = ["PRESETS", "Gemma3", "Gemma3Config", "hf"]
