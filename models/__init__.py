"""Models written for one device, and their named presets."""

from types import ModuleType

from models import deepseek3, gemma3, llama, mistral, olmo2, qwen2, qwen3
from models.deepseek3 import DeepSeekV3Config
from models.gemma3 import Gemma3Config
from models.llama import Llama, LlamaConfig, RopeScaling
# What every family shares with Llama's (the trainer reads these, never a family's module):
# remat policies, the decoding state, a Hugging Face tensor's description, config.json's size bound
# and the names PEFT gives LoRA adapters' tensors (every family's projections are Llama's).
from models.llama.hf import MAX_CONFIG_BYTES, Tensor, adapter_tensors
from models.llama.layers import Decoding
from models.llama.model import REMAT_POLICIES
from models.mistral import MistralConfig
from models.olmo2 import Olmo2Config
from models.moe import MoEConfig, Routing
from models.qwen2 import Qwen2Config
from models.qwen3 import Qwen3Config

# Each family: its config class -> its module class. What each owes is code, models.family
# (Config, Model, Block, Attention, HFLayout), checked for every family here by tests/test_model.py.
FAMILIES: dict[type, type] = {LlamaConfig: Llama, Qwen3Config: qwen3.Qwen3, Qwen2Config: qwen2.Qwen2,
                              MistralConfig: mistral.Mistral, Gemma3Config: gemma3.Gemma3,
                              DeepSeekV3Config: deepseek3.DeepSeekV3, Olmo2Config: olmo2.Olmo2}
# Each family's Hugging Face layout module (models.family.HFLayout).
HF_LAYOUTS: dict[type, ModuleType] = {LlamaConfig: llama.hf, Qwen3Config: qwen3.hf, Qwen2Config: qwen2.hf,
                                      MistralConfig: mistral.hf, Gemma3Config: gemma3.hf,
                                      DeepSeekV3Config: deepseek3.hf, Olmo2Config: olmo2.hf}


def model_class(cfg) -> type:
    return FAMILIES[type(cfg)]


def config_from_dict(d: dict) -> LlamaConfig:
    """A model config saved as data (`dataclasses.asdict`, as a run saves it), of the family
    it names (Llama's when it names none, as runs saved before families did)."""
    classes = {cls.family: cls for cls in FAMILIES}
    return classes[d.get("family", "llama")].from_dict(d)


def hf_layout(cfg=None, architectures: list | None = None) -> ModuleType:
    """The Hugging Face layout of a config of ours, or of config.json's `architectures`."""
    if cfg is not None:
        return HF_LAYOUTS[type(cfg)]
    for layout in HF_LAYOUTS.values():
        if architectures and architectures[0] in layout.ARCHITECTURES:
            return layout
    known = ", ".join(a for layout in HF_LAYOUTS.values() for a in layout.ARCHITECTURES)
    raise llama.hf.UnsupportedConfig("architectures", f"{architectures!r} is not one of {known}")


# Every family's presets, by name.
PRESETS: dict[str, LlamaConfig] = {**llama.PRESETS, **qwen3.PRESETS, **qwen2.PRESETS, **mistral.PRESETS,
                                   **gemma3.PRESETS, **deepseek3.PRESETS, **olmo2.PRESETS}

__all__ = ["FAMILIES", "DeepSeekV3Config", "MAX_CONFIG_BYTES", "PRESETS", "REMAT_POLICIES", "Decoding", "Gemma3Config", "Llama", "LlamaConfig",
           "MistralConfig", "MoEConfig", "Olmo2Config", "Qwen2Config", "Qwen3Config", "RopeScaling", "Routing", "Tensor",
           "adapter_tensors", "config_from_dict", "hf_layout", "model_class"]
