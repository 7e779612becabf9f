"""DeepSeek-V3 (and V2-Lite's shapes): multi-head latent attention, a dense prefix, group-
limited routing, YaRN (`model`, `config`), its Hugging Face layout (`hf`), its named shapes
(`presets`)."""

from models.deepseek3 import hf
from models.deepseek3.config import DeepSeekV3Config, Yarn
from models.deepseek3.model import DeepSeekV3
from models.deepseek3.presets import PRESETS

__all__ = ["PRESETS", "DeepSeekV3", "DeepSeekV3Config", "Yarn", "hf"]
