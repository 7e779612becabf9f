"""What every data source is fed through: the run's source chosen from its options
(make_source), the batch of a step as one global array built from this process's rows
(global_batch), and the batches of the next steps built ahead on a thread (Prefetcher).

Row `r` of the batch of step `k` is a pure function of the source, `k` and `r`: the order
never depends on the mesh or the number of processes, and each process builds only the
rows its own devices hold.
"""

from __future__ import annotations

import queue
import threading

import jax
import numpy as np

from spmd.base.cli import changed
from spmd.data.corpus import TokenSource, token_stream
from spmd.data.packed_file import PackedFileSource, read_packed
from spmd.data.records import RECORD_OPTIONS, TEXT_OPTIONS, fine_tuning_format, refuse_what_does_not_apply
from spmd.data.stream import Rows, record_source
from spmd.data.synthetic import MarkovSource
from spmd.data.tokenizer import load_tokenizer


def make_source(data, training, vocab: int):
    """The run's data (the data and training sections of its options, spmd.run.options):
    fine-tuning records packed into rows as training reaches them
    (spmd.data.stream.RecordSource), rows packed by spmd.corpus
    (spmd.data.packed_file.PackedFileSource), other `--data` as windows of its token
    stream (spmd.data.corpus.TokenSource), else the synthetic chain."""
    if not data.path:
        return MarkovSource(vocab, training.seed)
    held_out = data.eval_fraction if data.eval_every else 0.0
    shape = (training.seq + 1, training.batch, training.seed, held_out)  # (a row's tokens, rows a step, ...)
    if (packed := read_packed(data.path)) is not None:
        return PackedFileSource(packed, *shape, name=data.path, vocab=vocab)
    records = fine_tuning_format(data.path, data.max_record_bytes)
    refuse_what_does_not_apply(changed(data, RECORD_OPTIONS + TEXT_OPTIONS), records, data.path)
    if records:
        return record_source(data.path, data.tokenizer, Rows(*shape), vocab=vocab, loss_on=data.loss_on,
                             overlong=data.overlong, workers=data.data_workers, max_record_bytes=data.max_record_bytes)
    tokenizer = load_tokenizer(data.tokenizer)
    stream = token_stream(data.path, tokenizer, data.text_field, data.token_dtype, vocab)
    return TokenSource(stream, *shape, name=data.path, tokenizer=data.tokenizer or "UTF-8 bytes",
                       document_end=tokenizer.eos if data.document_mask else None)


def global_batch(source, step: int, batch: int, length: int, sharding: jax.sharding.Sharding,
                 split: str = "train") -> jax.Array | dict:
    """Step `step`'s batch (batch, length) as one global array, built from this process's
    rows of `source` (a MarkovSource, a spmd.data.corpus.TokenSource or a
    spmd.data.stream.RecordSource): a dict of such arrays when the source's rows are
    packed (tokens, segments, loss_mask).

    Every distinct row range that a local device holds is generated once (devices that
    replicate a range, e.g. along tp, share it).
    """
    shape = (batch, length)
    index_map = sharding.addressable_devices_indices_map(shape)
    cache: dict[tuple[int, int], np.ndarray | dict] = {}
    pieces = []
    for index in index_map.values():
        key = _row_range(index, batch)
        if key not in cache:
            cache[key] = source.rows(step, *key, length, split)
        pieces.append(jax.tree.map(lambda rows: rows[:, index[1]], cache[key]))
    arrays = jax.device_put(pieces, list(index_map))  # one batched transfer
    if not isinstance(pieces[0], dict):
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
    return {name: jax.make_array_from_single_device_arrays(shape, sharding, [a[name] for a in arrays])
            for name in pieces[0]}


def _row_range(index: tuple[slice, ...], batch: int) -> tuple[int, int]:
    rows = index[0]
    return (rows.start or 0, batch if rows.stop is None else rows.stop)


class Prefetcher:
    """Builds the batches of steps [start, stop) on a background thread, `depth` ahead,
    so the host's data work overlaps the devices' step instead of adding to it."""

    def __init__(self, make_batch, start: int, stop: int, depth: int = 2):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(make_batch, start, stop), daemon=True)
        self._thread.start()

    def _fill(self, make_batch, start: int, stop: int) -> None:
        for step in range(start, stop):
            try:
                item = (make_batch(step), None)
            except Exception as exc:  # handed to the consumer, raised there
                item = (None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None or self._stop.is_set():
                return

    def next(self) -> jax.Array:
        batch, exc = self._queue.get()
        if exc is not None:
            raise exc
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
