"""The family contract as code: what a model family (a folder of models/, registered in
models/__init__.py) gives the trainer and the converters. Each family's config, model
class, block, attention and Hugging Face layout module is checked against these by
`breaches` for every registered family (tests/test_model.py), so a new family learns
what it owes from a failing test rather than from a comment.

The hooks a family states instead of replacing parts after construction:
- `Config.NORMS` (models.llama.config.Norms): a block's norms before and/or after each
  sublayer, and the q/k norms' span (per head, or over the whole projection);
  `Config.block_norms` is the one description the block builds its norms from, the
  Hugging Face layout names (models.llama.hf.norm_tensors) and `num_params` counts.
- `Attention.NORM`, `_frequencies`, `_scaled`; `Block.ATTENTION`, `MLP`, `NORM`;
  `Model.BLOCK`, `EMBED_SCALE`.
- Keys and values are computed per slot (a kv head or one of its copies when tp splits
  the query heads more finely: `Attention._project`): what a family adds per kv head is
  repeated along the kv_heads axis there, and the cache keeps one copy.
- `HFLayout.tensor_count` is counted from `tensors` (models.llama.hf.count_of), never
  restated by arithmetic.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol


class Config(Protocol):
    """A family's config: a frozen dataclass extending models.llama.LlamaConfig."""

    family: str  # its name when saved as data (models.config_from_dict)
    NORMS: ClassVar[Any]  # models.llama.config.Norms

    @classmethod
    def from_dict(cls, d: dict) -> Config: ...
    def block_norms(self) -> dict: ...
    def num_params(self, active: bool = False) -> int: ...
    def projection_shapes(self) -> dict: ...
    def attention_width(self) -> int: ...
    def attention_input_gradient(self) -> int: ...


class Attention(Protocol):
    """Its parts' hooks (models.llama.model.Attention)."""

    NORM: ClassVar[type]

    def __call__(self, x, positions, packing=None, local=None): ...
    def decode(self, x, positions, cache, block, at, local=None): ...


class Block(Protocol):
    """A block's parts (models.llama.model.Block): its norms are the config's `block_norms`."""

    ATTENTION: ClassVar[type]
    MLP: ClassVar[type]
    NORM: ClassVar[type]

    def __call__(self, x, positions, packing=None, local=None): ...
    def decode(self, x, positions, cache, block, at, local=None): ...


class Model(Protocol):
    """What the trainer reads of a family's model class (models.FAMILIES' values), never
    naming a parameter itself."""

    STACKED: ClassVar[str]
    LOOKUP_TABLE: ClassVar[str]
    RECOMPUTED_INPUT_WEIGHTS: ClassVar[tuple]
    BLOCK: ClassVar[type]
    EMBED_SCALE: ClassVar[bool]
    FUSED: ClassVar[dict]
    REMAT: ClassVar[tuple]

    @staticmethod
    def decays(path: tuple[str, ...]) -> bool: ...
    @staticmethod
    def head_params(cfg) -> tuple[str, ...]: ...
    @classmethod
    def merge_adapters(cls, params: dict, cfg, lora) -> dict: ...
    @staticmethod
    def layer_kinds(cfg): ...
    @staticmethod
    def cache_layout(cfg, batch: int, length: int) -> dict: ...
    def remat_policy(self): ...
    def forward(self, tokens, positions=None, packing=None): ...
    def hidden(self, tokens, positions=None, packing=None): ...
    def embed(self, tokens, positions=None, packing=None): ...
    def run_stack(self, stack, first, count, x, positions, packing=None): ...
    def logits(self, x, norm=None): ...
    def decode(self, tokens, positions, cache, at): ...


class HFLayout(Protocol):
    """A family's Hugging Face layout module (models.HF_LAYOUTS' values)."""

    ARCHITECTURES: dict[str, str]  # each architecture it reads, with its model_type

    def config_values(self, hf: dict) -> dict: ...  # config.json checked against its field tables
    def config_from_hf(self, hf: dict) -> Config: ...
    def config_to_hf(self, cfg) -> dict: ...
    def supported(self, cfg) -> str | None: ...  # why a config has no such layout (None: it has one)
    def tensors(self, cfg) -> Sequence: ...  # models.llama.hf.Tensor, each ours <-> the published ones
    def tensor_count(self, cfg) -> tuple[int, str]: ...  # counted from tensors; the fields deciding it
    def copies(self, cfg) -> dict: ...  # published tensors that may repeat another (a tied head)


def _members(protocol: type) -> dict[str, Any]:
    """The protocol's members: annotated attributes (None) and methods (the function)."""
    names = {n: None for n in getattr(protocol, "__annotations__", {})}
    for name, value in vars(protocol).items():
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if callable(value) and (not name.startswith("_") or name == "__call__"):
            names[name] = value
    return names


def _parameters(fn: Callable, bound: bool) -> list[str]:
    params = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return params[1:] if bound and params and params[0] in ("self", "cls") else params


def breaches(obj: Any, protocol: type) -> list[str]:
    """How `obj` (a class, or a module) fails `protocol`: members it lacks, and methods whose
    parameters are not the protocol's by name and order (extra trailing ones with defaults
    are allowed). Empty: it keeps the contract."""
    found = []
    for name, want in _members(protocol).items():
        if not hasattr(obj, name):
            found.append(f"{name}: missing")
            continue
        got = inspect.getattr_static(obj, name) if inspect.isclass(obj) else getattr(obj, name)
        if want is None:
            continue
        if isinstance(got, (staticmethod, classmethod)):
            got = got.__func__
        if not callable(got):
            found.append(f"{name}: not callable")
            continue
        expected = _parameters(want, bound=True)
        actual = _parameters(got, bound=inspect.isclass(obj))
        if actual[:len(expected)] != expected:
            found.append(f"{name}: takes {actual}, the contract {expected}")
    return found
