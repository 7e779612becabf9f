"""The Qwen2 family (Qwen2, Qwen2.5): Llama's module with biases on the query, key and
value projections (`model`), its Hugging Face layout (`hf`), its named shapes (`presets`)."""

from models.qwen2 import hf
from models.qwen2.model import Qwen2, Qwen2Config
from models.qwen2.presets import PRESETS

__all__ = ["PRESETS", "Qwen2", "Qwen2Config", "hf"]
