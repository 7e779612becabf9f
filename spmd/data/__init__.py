"""Data: the built-in synthetic source and the step-indexed batches (synthetic), and text
and token files with their tokenizers (corpus)."""

_SYNTHETIC = ("MarkovSource", "Prefetcher", "global_batch", "make_source")


def __getattr__(name: str):
    """The synthetic source's names, imported on first use: spmd.data.corpus needs no JAX,
    and `python -m spmd.corpus` starts without it."""
    if name in _SYNTHETIC:
        from spmd.data import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
