"""Peak dense bf16 throughput of common accelerators, and the model FLOPs of a step.

MFU = achieved model FLOP/s per device / the device's peak (PaLM's definition: the
FLOPs the model needs, not what the hardware executed, so remat does not inflate it).
"""

from __future__ import annotations

# Substring of `jax.Device.device_kind` -> dense bf16 TFLOP/s per device (vendor figures).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "TPU v6": 918.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v4": 275.0,
}


def peak_tflops(device_kind: str) -> float | None:
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return tflops
    return None


def train_flops_per_token(model_cfg, seq: int) -> float:
    """6 x (parameters used in matmuls) + causal attention 6 x layers x heads x head_dim x seq."""
    c = model_cfg
    lookup_only = 0 if c.tie_embeddings else c.vocab * c.embed  # the input table is gathered, not multiplied
    matmul_params = c.num_params() - lookup_only
    attention = 6 * c.layers * c.heads * c.head_dim * seq
    return 6.0 * matmul_params + attention
