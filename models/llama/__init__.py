"""The Llama family: Llama 2 and 3 (grouped-query attention, RoPE with Llama 3.1's scaling)
and Mixtral (Llama blocks whose MLP is a mixture of experts). `model` is the Flax module,
`hf` its Hugging Face layout (config.json and tensors), `presets` its named shapes."""

from models.llama import hf
from models.llama.config import LlamaConfig, RopeScaling
from models.llama.layers import Decoding
from models.llama.model import REMAT_POLICIES, Llama
from models.llama.presets import PRESETS

__all__ = ["PRESETS", "REMAT_POLICIES", "Decoding", "Llama", "LlamaConfig", "RopeScaling", "hf"]
