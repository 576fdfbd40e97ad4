"""Where ``ft.batches`` takes a step's samples from: tensors, a dataset, a DataLoader or a function.

:func:`data_source` turns what a training loop passes to :func:`monarch_nb.ft.batches` into a
:class:`DataSource`, which fetches the samples of a list of indices (this rank's shard of one
step's global batch, see :mod:`.data`) as one batch:

- a tuple or list of tensors with the samples along dim 0 (``(inputs, targets)``): indexed
  directly, the fastest;
- a map-style dataset (``len(ds)``, ``ds[i]``): ``ds.__getitems__(indices)`` where it has one (as
  torch's own DataLoader uses it), else one ``ds[i]`` per index; then ``collate_fn`` (torch's
  ``default_collate`` unless given);
- a ``torch.utils.data.DataLoader``: its dataset and ``collate_fn``; with ``num_workers > 0`` its
  worker processes load the steps of a window ahead of time (persistent workers; a batch sampler
  of this module feeds them the window's shards). The loader's own sampler and shuffling are not
  used: the order of samples is the run's pure order, so no failure loses or repeats one;
- a function ``fn(indices) -> batch`` with ``num_samples`` given.

Runs in procs (and in the controller for a loop run locally).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

__all__ = ["DataSource", "data_source"]


class DataSource:
    """``fetch(indices)`` -> one batch; ``num_samples`` is the size of the dataset.

    ``prefetch(shards)`` announces the shards of the steps coming next (a window's), so that a
    DataLoader's workers load them ahead; ``fetch`` then takes them in that order.
    """

    num_samples: int = 0

    def fetch(self, indices: Sequence[int]) -> Any:
        raise NotImplementedError

    def prefetch(self, shards: list[Sequence[int]]) -> None:
        """The shards the next ``fetch`` calls will ask for, in order (a hint; default: ignored)."""

    def close(self) -> None:
        """Release worker processes, if any."""


class _Tensors(DataSource):
    def __init__(self, tensors: Sequence[Any]):
        import torch

        self.tensors = list(tensors)
        sizes = {len(t) for t in self.tensors}
        if len(sizes) != 1:
            raise ValueError(f"ft.batches: the tensors hold different numbers of samples along dim 0: {sorted(sizes)}")
        self.num_samples = sizes.pop()
        self._torch = torch

    def fetch(self, indices: Sequence[int]) -> Any:
        idx = self._torch.as_tensor(indices, dtype=self._torch.int64)
        return tuple(t[idx] for t in self.tensors)


class _Dataset(DataSource):
    def __init__(self, dataset: Any, collate_fn: Callable | None):
        from torch.utils.data import default_collate

        self.dataset = dataset
        self.num_samples = len(dataset)
        self.collate = collate_fn or default_collate
        self._many = getattr(dataset, "__getitems__", None)

    def fetch(self, indices: Sequence[int]) -> Any:
        ids = [int(i) for i in indices]
        samples = self._many(ids) if self._many is not None else [self.dataset[i] for i in ids]
        return self.collate(samples)


class _Function(DataSource):
    def __init__(self, fn: Callable[[Sequence[int]], Any], num_samples: int):
        self.fn, self.num_samples = fn, num_samples

    def fetch(self, indices: Sequence[int]) -> Any:
        return self.fn(indices)


class _WindowSampler:
    """A batch sampler whose batches are the shards announced by :meth:`_Loader.prefetch`."""

    def __init__(self) -> None:
        self.shards: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.shards))

    def __len__(self) -> int:
        return len(self.shards)


class _Loader(DataSource):
    """A DataLoader's dataset and collate_fn, loaded by its worker processes a window ahead."""

    def __init__(self, loader: Any):
        from torch.utils.data import DataLoader

        self.dataset = loader.dataset
        self.num_samples = len(loader.dataset)
        self.sampler = _WindowSampler()
        self.loader = DataLoader(
            loader.dataset, batch_sampler=self.sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, persistent_workers=True,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
        )
        self._direct = _Dataset(loader.dataset, loader.collate_fn)
        self._queue: list[list[int]] = []
        self._it: Iterator | None = None

    def prefetch(self, shards: list[Sequence[int]]) -> None:
        self._queue = [[int(i) for i in s] for s in shards]
        self.sampler.shards = list(self._queue)
        self._it = iter(self.loader)  # the persistent workers start on this window's shards

    def fetch(self, indices: Sequence[int]) -> Any:
        ids = [int(i) for i in indices]
        if self._it is not None and self._queue and self._queue[0] == ids:
            self._queue.pop(0)
            return next(self._it)
        self._it, self._queue = None, []  # not what was announced (a redo): load it here
        return self._direct.fetch(ids)

    def close(self) -> None:
        self._it = None
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()


def data_source(source: Any, *, num_samples: int | None = None, collate_fn: Callable | None = None) -> DataSource:
    """The :class:`DataSource` of what a loop passed to ``ft.batches``.

    Raises:
        TypeError: ``source`` is none of the supported kinds (the message lists them).
        ValueError: a function without ``num_samples``, tensors of different lengths, or an empty dataset.
    """
    import torch
    from torch.utils.data import DataLoader

    if isinstance(source, DataSource):
        made = source
    elif isinstance(source, DataLoader):
        made = _Loader(source) if source.num_workers > 0 else _Dataset(source.dataset, source.collate_fn)
    elif isinstance(source, (tuple, list)) and source and all(isinstance(t, torch.Tensor) for t in source):
        made = _Tensors(source)
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        made = _Dataset(source, collate_fn)
    elif callable(source):
        if num_samples is None:
            raise ValueError("ft.batches(fn, ...): a function source needs num_samples= (the dataset's size)")
        made = _Function(source, int(num_samples))
    else:
        raise TypeError(
            f"ft.batches cannot take samples from a {type(source).__name__}: pass a tuple of tensors "
            "(samples along dim 0), a map-style dataset (len and [i]), a torch DataLoader, or a function "
            "fn(indices) -> batch with num_samples=")
    if made.num_samples <= 0:
        raise ValueError("ft.batches: the dataset is empty")
    return made
