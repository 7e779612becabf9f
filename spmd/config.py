"""The run's options, at the import path of the Python API (`TrainConfig`, by section, and
the model it builds as `TrainConfig.model_cfg`; `validate`); the code lives in spmd.run.options,
spmd.run.config and spmd.run.resolve."""

from spmd.run.config import TrainConfig, find_config, train_parser
from spmd.run.resolve import parse_args, parse_with_extras, validate

__all__ = ["TrainConfig", "find_config", "parse_args", "parse_with_extras", "train_parser", "validate"]
