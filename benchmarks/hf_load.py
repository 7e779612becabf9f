"""How much host memory loading a Hugging Face checkpoint takes, and how long placing it on
a mesh takes: `spmd.formats.hf.load_params` reads one layer of one parameter at a time and places
each device's slice, so the host's share should stay near the largest published tensor,
not grow with the model.

    python benchmarks/hf_load.py [--mesh fsdp=4,tp=2] [--dir /tmp/spmd-hf-bench]

Writes a random Llama in Hugging Face's layout (bfloat16, about 330 MB, in 5 shards),
loads it onto emulated CPU devices and prints: peak RSS of the loading over the RSS before
it, less what the placed arrays hold (CPU devices keep their arrays in this process's
memory too), as a ratio to the largest published tensor and to the whole checkpoint.
"""

import argparse
import json
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

# Llama-shaped, ~165M parameters: a 32k vocabulary (the largest tensors: the embedding
# and the head, 65.5 MB each in bfloat16), 8 layers of width 1024.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
          "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
          "intermediate_size": 2816, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def write_checkpoint(directory: Path) -> tuple[int, int]:
    """A random model in `directory`; -> (checkpoint bytes, largest tensor's bytes)."""
    import ml_dtypes

    from models.llama.hf import config_from_hf, tensors
    from spmd.formats.safetensors import Writer

    cfg = config_from_hf(CONFIG)
    entries = [(name, shape) for t in tensors(cfg) for i in range(cfg.layers if t.stacked else 1)
               for name, shape in zip(t.names(i), t.shapes)]
    sizes = [int(np.prod(shape)) * 2 for _, shape in entries]
    per_file = sum(sizes) // 5 + 1  # five files
    rng = np.random.default_rng(0)
    groups, size = [[]], 0
    for entry, nbytes in zip(entries, sizes):
        if groups[-1] and size + nbytes > per_file:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += nbytes
    weight_map = {}
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        writer = Writer(directory / file, group, ml_dtypes.bfloat16)
        for name, shape in group:
            writer.write(name, (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16))
            weight_map[name] = file
        writer.close()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return sum(sizes), max(sizes)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class PeakRss:
    """The highest RSS seen while the block runs (sampled every millisecond)."""

    def __enter__(self):
        self.peak, self.running = rss_bytes(), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss_bytes())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="fsdp=4,tp=2")
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    from spmd.parallel.mesh import emulate_cpu_devices, parse_mesh

    emulate_cpu_devices(parse_mesh(args.mesh), None)

    import jax

    from spmd.config import TrainConfig
    from spmd.formats.hf import Directory, load_params
    from spmd.layout import make_layout

    root = Path(args.dir or tempfile.mkdtemp(prefix="spmd-hf-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        total, largest = write_checkpoint(root)
        directory = Directory(root)
        layout = make_layout(TrainConfig.of(mesh=args.mesh, architecture=directory.cfg),
                             for_training=False)
        jax.block_until_ready(jax.numpy.zeros(8))  # the backend started before the baseline
        baseline = rss_bytes()
        started = time.perf_counter()
        with PeakRss() as watch:
            params = jax.block_until_ready(load_params(directory, layout))
        seconds = time.perf_counter() - started
        placed = sum(shard.data.nbytes for leaf in jax.tree.leaves(params) for shard in leaf.addressable_shards)
        host = watch.peak - baseline - placed
        mib = 2**20
        print(f"checkpoint: {total / mib:.0f} MiB bfloat16 in 5 files; largest tensor {largest / mib:.1f} MiB")
        print(f"placed on {args.mesh} ({len(layout.mesh.devices.flat)} CPU devices): {placed / mib:.0f} MiB float32 "
              f"in all devices, in {seconds:.1f} s")
        print(f"host memory of the loading, beyond what the devices hold: {host / mib:.0f} MiB = "
              f"{host / largest:.2f} x the largest tensor = {host / total:.2f} x the checkpoint")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
