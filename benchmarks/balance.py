"""Expert load balancing on a skewed router: per-device load imbalance over 100 steps
without balancing, with the router's selection bias, and with redundant experts (EPLB).

The data favour a few experts: the token stream draws from 12 of the vocabulary's ids,
with Zipf frequencies, so a few inputs make most of every batch and the router's choices
for them dominate. moe-tiny with 4 layers (2 MoE layers of 8 experts, top 2) trains on
ep=4 for 100 steps in each mode, the balancing loss off in all (so that only the method
measured balances):
- none;
- bias: --router-bias-rate 0.001 (DeepSeek-V3's rate, for runs of many thousand steps)
  and 0.01 (which can move a softmax score's ranking within 100 steps);
- EPLB: --redundant-experts 4 (12 slots, 3 per device), rebalanced every 10 steps;
- both.
Printed per mode: the mean per-device imbalance (max over mean of the choices the ep
devices' slots take) over steps 1-10, 41-50 and 91-100 and over all 100, the per-expert
imbalance over all, and the final loss.

    python benchmarks/balance.py
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 4)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from spmd.config import TrainConfig, validate  # noqa: E402
from spmd.layout import make_layout  # noqa: E402
from spmd.train import train  # noqa: E402

STEPS = 100
BASE = dict(model="moe-tiny", layers=4, mesh="ep=4", batch=16, seq=64, steps=STEPS, warmup=10, aux_loss_weight=0.0,
            log_every=STEPS)
MODES = {
    "none": {},
    "bias 0.001": {"router_bias_rate": 0.001},
    "bias 0.01": {"router_bias_rate": 0.01},
    "EPLB R=4/10": {"redundant_experts": 4, "rebalance_every": 10},
    "both": {"router_bias_rate": 0.01, "redundant_experts": 4, "rebalance_every": 10},
}


def skewed_tokens(path: str, n: int = 400_000, distinct: int = 12, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ids = rng.choice(256, distinct, replace=False)
    zipf = 1.0 / np.arange(1, distinct + 1)
    np.save(path, rng.choice(ids, n, p=zipf / zipf.sum()).astype(np.uint16))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "skewed.npy")
        skewed_tokens(data)
        print(f"moe-tiny, 2 MoE layers x 8 experts (top 2), ep=4, {STEPS} steps on skewed tokens; "
              "device imbalance = max / mean choices per ep device")
        print(f"{'mode':<14} {'steps 1-10':>10} {'41-50':>7} {'91-100':>7} {'all':>7} {'per expert':>11} {'loss':>7}")
        for name, options in MODES.items():
            cfg = validate(TrainConfig.of(**BASE, **options, data=data))
            records, _ = train(cfg, make_layout(cfg, jax.devices()[:4]), log=lambda _: None)
            device = np.array([r["device_imbalance"] for r in records])
            expert = np.mean([r["imbalance"] for r in records])
            print(f"{name:<14} {device[:10].mean():>10.2f} {device[40:50].mean():>7.2f} {device[90:].mean():>7.2f} "
                  f"{device.mean():>7.2f} {expert:>11.2f} {records[-1]['loss']:>7.3f}")


if __name__ == "__main__":
    main()
