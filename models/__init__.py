"""Models written for one device, and their named presets."""

from types import ModuleType

from models import llama
from models.llama import Llama, LlamaConfig, RopeScaling
from models.moe import MoEConfig, Routing

# Each family: its config class -> its module class. A model class tells the trainer what
# it needs beyond the call (see Llama: STACKED, LOOKUP_TABLE, decays, head_params), and
# decodes with a key/value cache (cache_shape, decode).
FAMILIES: dict[type, type] = {LlamaConfig: Llama}
# Each family's Hugging Face layout (see models.llama.hf): ARCHITECTURES it reads,
# config_values (config.json checked against its field tables), config_from_hf,
# config_to_hf, supported (why a config has no such layout), tensors, tensor_count (how
# many published tensors a config implies, before any per-layer loop) and copies
# (published tensors that may repeat another, as a tied head).
HF_LAYOUTS: dict[type, ModuleType] = {LlamaConfig: llama.hf}


def model_class(cfg) -> type:
    return FAMILIES[type(cfg)]


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
PRESETS: dict[str, LlamaConfig] = {**llama.PRESETS}

__all__ = ["FAMILIES", "Llama", "LlamaConfig", "MoEConfig", "PRESETS", "RopeScaling", "Routing", "hf_layout",
           "model_class"]
