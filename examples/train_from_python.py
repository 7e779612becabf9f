"""Train from Python instead of the CLI: the same config, layout and loop.

    python examples/train_from_python.py
"""

from spmd.config import TrainConfig, validate
from spmd.mesh import emulate_cpu_devices, parse_mesh

cfg = validate(TrainConfig.of(mesh="fsdp=4,tp=2", steps=100, log_every=25))
emulate_cpu_devices(parse_mesh(cfg.parallelism.mesh), None)  # before JAX starts: 8 CPU devices if no GPU/TPU

from spmd.layout import make_layout  # noqa: E402
from spmd.train import train  # noqa: E402

records, state = train(cfg, make_layout(cfg))
print("first loss", records[0]["loss"], "last loss", records[-1]["loss"])
print("wq is stored as", state["params"]["blocks"]["attn"]["wq"].sharding.spec)
