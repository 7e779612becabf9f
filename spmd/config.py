"""The run's options, at the import path of the Python API (`TrainConfig`, `validate`,
`model_config`); the code lives in spmd.run.config and spmd.run.resolve."""

from spmd.parallel.skeleton import model_config
from spmd.run.config import TrainConfig, find_config, train_parser
from spmd.run.resolve import parse_args, parse_with_extras, validate

__all__ = ["TrainConfig", "find_config", "model_config", "parse_args", "parse_with_extras", "train_parser", "validate"]
