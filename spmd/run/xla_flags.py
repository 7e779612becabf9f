"""XLA settings per backend, in one place: the flags that let collectives overlap compute.

On GPU they go into `XLA_FLAGS`, on TPU into `LIBTPU_INIT_ARGS`; on the CPU nothing is set.
A flag the user's variable already names is left as the user set it (whatever its value).

When: XLA reads both variables once, when JAX starts its backend (the first
`jax.devices()`, array or compilation), not when `jax` is imported. Seen on jax 0.10.2 and
0.12.0.1 (CPU): `import jax, flax, optax` and all of spmd's modules, then
`os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"`, then
`jax.devices()` gives 3 devices. The trainer relies on this: it sets the flags after
parsing its options (the model and dtype size the thresholds), before anything starts a
backend. `configure` says so instead of changing anything when the backend already started.

Which backend: `backend_before_start()` decides without starting one (JAX_PLATFORMS, else
the installed plugin whose device the host shows), since the flags must be in place before
JAX looks.

Unknown flags abort: XLA stops at backend start on a name its flag registry lacks
("Unknown flag in XLA_FLAGS"), and that registry (DebugOptions) is one for all backends,
so every GPU flag here must be known to the installed jaxlib even on a CPU.
tests/test_xla_flags.py starts a CPU backend with all of them; a jax upgrade that drops
one fails it. Checked by hand on jax 0.10.2 and 0.12.0.1; dropped for being unknown to
both: `--xla_gpu_enable_async_collectives` (collectives are async by default now; the
JAX-Toolbox guide still lists it) and `--xla_gpu_enable_pipelined_collectives` (split
into the three pipelined_* flags).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping

import numpy as np
from jax._src import xla_bridge

from spmd.base import accelerators
from spmd.parallel.pipeline.schedule import Schedule

# GPU (NVIDIA), after MaxText's GPU scripts and JAX-Toolbox's / JAX's GPU performance
# guides: schedule collectives to overlap compute, and in the scanned layers start the
# next layer's weight all-gather (and finish the last layer's gradient reduce-scatter or
# all-reduce) one iteration apart from the compute that needs it.
GPU_FLAGS: dict[str, str] = {
    # Moves async collectives early/late to overlap them with independent compute.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Launches collectives on the highest-priority stream, so compute kernels do not starve them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # Pipelining across iterations of the scan over layers (FSDP's per-layer all-gather,
    # ZeRO's reduce-scatter, DDP's all-reduce of each layer's gradient).
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_pipelined_all_reduce": "true",
    # Unrolls the scan by two, so one iteration's collective overlaps the other's compute.
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # A gradient all-reduce over dp+fsdp whose result each device slices by fsdp (HSDP)
    # becomes a reduce-scatter over fsdp and an all-reduce over dp: 2/3 of the bytes on
    # dp=2,fsdp=2. XLA:GPU splits it only where another all-reduce already uses one of
    # those groups; compiled for 8 H100s (spmd.plan --target h100x8) it did not.
    "xla_gpu_all_reduce_splitter_ignore_profitability_check": "true",
}
# Flags that older jaxlibs refuse (XLA aborts on a flag it does not know): the first
# jaxlib that has each. Left out below it.
GPU_FLAGS_SINCE: dict[str, tuple[int, int]] = {"xla_gpu_all_reduce_splitter_ignore_profitability_check": (0, 12)}
# Combining thresholds: collectives smaller than this are merged into one. Sized to one
# layer's weights (combine_threshold_bytes): a layer's parameters travel in one collective,
# but the next layer's are not held back waiting for more.
GPU_THRESHOLD_FLAGS = (
    "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
)

# TPU (libtpu), after MaxText's flag library and TPU scripts: async collective fusion
# (continuation fusion) of all-gathers, overlapped with compute, and the data-parallel
# all-reduce optimizations. Each is taken by libtpu 0.0.50.1 compiling for v4, v5e, v5p and
# v6e topologies ahead of time (tests/test_target_tpu.py); no TPU was at hand to time them.
TPU_FLAGS: dict[str, str] = {
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
    "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
    "xla_tpu_data_parallel_opt_different_sized_ops": "true",
}
# libtpu takes this one on v5e alone ("Continuation fusion for AllGather ... not supported"
# on v5p and the others): added where the TPU VM's TPU_ACCELERATOR_TYPE names a v5e.
TPU_V5E_FLAGS: dict[str, str] = {"xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true"}
V5E_TYPES = ("v5litepod-", "v5e-")

VARIABLE = {"gpu": "XLA_FLAGS", "tpu": "LIBTPU_INIT_ARGS"}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}



def layer_params(model_cfg) -> int:
    """Parameters of one transformer block (the mean over blocks: MoE models alternate
    dense and MoE blocks): the model's less its embedding, head and final norm."""
    c = model_cfg
    outside = c.vocab * c.embed * (1 if c.tie_embeddings else 2) + c.embed
    return (c.num_params() - outside) // c.layers


def combine_threshold_bytes(model_cfg, dtype) -> int:
    """One layer's weights in the compute dtype (`"bfloat16"`, `"float32"` or a dtype)."""
    if isinstance(dtype, str):
        itemsize = _ITEMSIZE[dtype]
    else:
        itemsize = np.dtype(dtype).itemsize
    return layer_params(model_cfg) * itemsize


DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"


def gpu_flags(model_cfg, dtype, jaxlib_version: str | None = None, double_buffered: bool = True) -> list[str]:
    """GPU_FLAGS known to the jaxlib and the thresholds; loops not double-buffered where
    `double_buffered` is false (`double_buffers`)."""
    threshold = combine_threshold_bytes(model_cfg, dtype)
    installed = _release(jaxlib_version or _jaxlib_version())
    values = {**GPU_FLAGS, **({} if double_buffered else {DOUBLE_BUFFERING: "false"})}
    known = [name for name in values if installed >= GPU_FLAGS_SINCE.get(name, (0,))]
    return [f"--{name}={values[name]}" for name in known] + [f"--{name}={threshold}" for name in GPU_THRESHOLD_FLAGS]


def double_buffers(cfg) -> bool:
    """Whether a run's loops are double-buffered on GPUs: not under pipeline stages whose
    weight gradients are deferred (zb-v and DualPipe under --remat none,
    `Schedule.defers_weights`). Their loop carries rings of what B and W read, passed
    through the branches of each pair of ticks that do not write them, and a
    double-buffered loop had XLA:GPU copy each such ring in every trip: 123.4 GiB against
    the theory's 87.5 on llama3-8b at 16 layers, pp=4,dp=2, 8 microbatches of 4 x 4096,
    85.5 without (2026-12-06, --target h100x8). Under --remat full the peak is the same
    either way."""
    stages = cfg.parallelism.mesh_spec.sizes.get("pp", 1)
    return stages == 1 or not Schedule.of(cfg.step, stages).defers_weights


def _jaxlib_version() -> str:
    import jaxlib.version  # (no backend starts)

    return jaxlib.version.__version__


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def tpu_flags(accelerator_type: str) -> list[str]:
    """TPU_FLAGS, and TPU_V5E_FLAGS on a v5e (`accelerator_type` as the TPU VM's
    TPU_ACCELERATOR_TYPE names it: v5litepod-16; or spmd.plan's --target: v5e-16)."""
    v5e = accelerator_type.strip().lower().startswith(V5E_TYPES)
    flags = {**TPU_FLAGS, **(TPU_V5E_FLAGS if v5e else {})}
    return [f"--{name}={value}" for name, value in flags.items()]


def flag_names(value: str) -> set[str]:
    """The flag names in a variable like XLA_FLAGS: `--name=value` or `--name` (a bool)."""
    return {token.lstrip("-").split("=", 1)[0] for token in value.split() if token.startswith("-")}


def backend_before_start(environ: MutableMapping[str, str] = os.environ) -> str:
    """"gpu", "tpu" or "cpu": where JAX will run, decided without starting a backend
    (spmd.base.accelerators: JAX_PLATFORMS, else a plugin whose device the host shows)."""
    return accelerators.backend(environ)


def configure(backend: str, model_cfg, dtype, environ: MutableMapping[str, str] = os.environ,
              accelerator_type: str | None = None, double_buffered: bool = True) -> list[str]:
    """Add `backend`'s flags to its variable (XLA_FLAGS on "gpu", LIBTPU_INIT_ARGS on
    "tpu"), except those the variable already names; nothing on "cpu" (or anything else).
    Must run before JAX starts its backend (when `environ` is os.environ and the backend
    has started, nothing is changed and the one line says so). Returns the lines to print:
    what was set, and what was left as the user set it."""
    variable = VARIABLE.get(backend)
    if variable is None:
        return []
    if backend == "gpu":
        wanted = gpu_flags(model_cfg, dtype, double_buffered=double_buffered)
    else:
        wanted = tpu_flags(accelerator_type or environ.get("TPU_ACCELERATOR_TYPE", ""))
    if environ is os.environ and _backend_started():
        return [f"{variable} left unchanged: JAX's backend started already (set flags before the first jax.devices())"]
    current = environ.get(variable, "")
    users = flag_names(current)
    added = [flag for flag in wanted if flag_names(flag).isdisjoint(users)]
    kept = [flag for flag in wanted if not flag_names(flag).isdisjoint(users)]
    if added:
        environ[variable] = " ".join(filter(None, (current.strip(), *added)))
    lines = []
    if added:
        lines.append(f"{variable}: added {' '.join(added)}")
        if backend == "gpu" and any(name in flag for flag in added for name in GPU_THRESHOLD_FLAGS):
            mib = combine_threshold_bytes(model_cfg, dtype) / 2**20
            lines.append(f"{variable}: collectives combined up to {mib:.0f} MiB (one layer's weights in {_name(dtype)})")
        if f"--{DOUBLE_BUFFERING}=false" in added:
            lines.append(f"{variable}: loops not double-buffered: the pipeline's deferred weight gradients keep rings "
                         "that XLA:GPU would copy in every trip")
    if kept:
        lines.append(f"{variable}: left as you set them: {', '.join(sorted(flag_names(' '.join(kept))))}")
    return lines


def _name(dtype) -> str:
    return dtype if isinstance(dtype, str) else getattr(dtype, "__name__", str(dtype))


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a private API: if it moved, assume not started
        return False
