"""The Qwen3 family (dense): Llama's module with per-head query and key norms (`model`),
its Hugging Face layout (`hf`), its named shapes (`presets`)."""

from models.qwen3 import hf
from models.qwen3.model import Qwen3, Qwen3Config
from models.qwen3.presets import PRESETS

__all__ = ["PRESETS", "Qwen3", "Qwen3Config", "hf"]
