"""Data: what every source is to the trainer, the loop and evaluation (source), the run's
source chosen and its step-indexed batches as global arrays (feed); the built-in synthetic
chain (synthetic); text and token files (corpus) with their tokenizers (tokenizer, chat);
fine-tuning records (records), found by offset (index), tokenized in worker processes
(workers), packed into rows (packing) window by window as training reaches them (stream)
or into a file ahead (packed_file)."""

_FEED = ("Prefetcher", "global_batch", "make_source")


def __getattr__(name: str):
    """The feed's names, imported on first use: spmd.data.corpus needs no JAX, and
    `python -m spmd.corpus` starts without it."""
    if name in _FEED:
        from spmd.data import feed

        return getattr(feed, name)
    if name == "MarkovSource":
        from spmd.data import synthetic

        return synthetic.MarkovSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
