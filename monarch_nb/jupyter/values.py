"""Moving values between the kernel and the ranks' namespaces: push, pull, scatter, gather.

The ``%mesh push/pull/scatter/gather`` magics and :class:`~.session.MeshProcs`' methods of the
same names call these. Values travel as the arguments and results of calls to the ranks' cell
executors, so tensors and numpy arrays go as out-of-band buffers, never copied into the pickle
stream (see :mod:`monarch_nb.transport.serialization`). Each operation runs on a rank after the
cells queued there before it (FIFO per rank), as a cell would.

``scatter`` splits along the first dimension into ``len(ranks)`` contiguous parts whose sizes
differ by at most one, the first ranks getting the larger ones (as ``numpy.array_split`` and
``torch.tensor_split``); ``gather`` joins the ranks' parts in rank order: tensors with
``torch.cat``, arrays with ``numpy.concatenate``, lists, tuples and strings by concatenation,
anything else as a list of the ranks' values.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["split", "join", "push", "pull", "scatter", "gather"]


def _module_of(value: Any) -> str:
    return type(value).__module__.split(".", 1)[0]


def split(value: Any, parts: int) -> list:
    """``value`` split along its first dimension into ``parts`` contiguous pieces.

    Raises:
        TypeError: ``value`` is not a sequence, a numpy array or a tensor.
        ValueError: ``parts`` is not positive.
    """
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if _module_of(value) == "torch" and hasattr(value, "tensor_split"):
        if value.dim() == 0:
            raise TypeError("a 0-d tensor has no first dimension to scatter along")
        return [chunk.contiguous() for chunk in value.tensor_split(parts)]
    if _module_of(value) == "numpy" and hasattr(value, "ndim"):
        if value.ndim == 0:
            raise TypeError("a 0-d array has no first dimension to scatter along")
        import numpy

        return [numpy.ascontiguousarray(chunk) for chunk in numpy.array_split(value, parts)]
    if isinstance(value, (dict, set, frozenset)) or not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
        raise TypeError(f"scatter needs a sequence, a numpy array or a tensor (split along the first "
                        f"dimension); got {type(value).__name__}")
    size, extra = divmod(len(value), parts)
    pieces, start = [], 0
    for i in range(parts):
        stop = start + size + (1 if i < extra else 0)
        pieces.append(value[start:stop])
        start = stop
    return pieces


def join(values: list) -> Any:
    """The ranks' parts joined in rank order (see the module doc)."""
    if not values:
        return []
    kinds = {_module_of(v) for v in values}
    if kinds == {"torch"} and all(hasattr(v, "dim") and v.dim() > 0 for v in values):
        return sys.modules["torch"].cat(values)
    if kinds == {"numpy"} and all(getattr(v, "ndim", 0) > 0 for v in values):
        return sys.modules["numpy"].concatenate(values)
    for kind in (list, tuple, str, bytes):
        if all(isinstance(v, kind) for v in values):
            return kind().join(values) if kind in (str, bytes) else kind(x for v in values for x in v)
    return list(values)


def _targets(session: Any, ranks: list[int] | None) -> list[int]:
    return list(range(session.world_size)) if ranks is None else list(ranks)


def _gather_futures(futures: list[tuple[int, Any]], timeout_s: float | None) -> dict[int, Any]:
    return {rank: future.get(timeout=timeout_s) for rank, future in futures}


def push(session: Any, values: dict, ranks: list[int] | None = None, timeout_s: float | None = None) -> list[int]:
    """Bind ``values`` (name -> value) in each selected rank's namespace; return the ranks.

    Raises:
        ValueError: a key is not a Python name.
        SupervisionError: a selected rank is dead.
    """
    bad = [name for name in values if not (isinstance(name, str) and name.isidentifier())]
    if bad:
        raise ValueError(f"not Python names: {bad!r}")
    targets = _targets(session, ranks)
    if ranks is None:  # one call to the whole mesh: the values are pickled once
        session.executors.set_names.call(values).get(timeout=timeout_s)
    else:
        _gather_futures([(r, session.executor_of(r).set_names.call_one(values)) for r in targets], timeout_s)
    return targets


def pull(session: Any, name: str, ranks: list[int] | None = None, timeout_s: float | None = None) -> Any:
    """``name``'s value on each selected rank: a ValueMesh over the mesh (all ranks), else a
    dict rank -> value.

    Raises:
        ActorError: ``name`` is not defined on a rank (NameError), or its value cannot be sent.
    """
    if ranks is None:
        from ..actor.value_mesh import ValueMesh

        got = session.executors.get_names.call([name]).get(timeout=timeout_s)
        return ValueMesh(got.extent, [d[name] for d in got.values()])
    got = _gather_futures([(r, session.executor_of(r).get_names.call_one([name])) for r in ranks], timeout_s)
    return {r: _only(v)[name] for r, v in got.items()}


def _only(value: Any) -> Any:
    """The value of a one-member ValueMesh (what ``call_one`` may give), or ``value`` itself."""
    from ..actor.value_mesh import ValueMesh

    if isinstance(value, ValueMesh) and len(value.values()) == 1:
        return value.values()[0]
    return value


def scatter(session: Any, name: str, value: Any, ranks: list[int] | None = None, timeout_s: float | None = None) -> dict[int, int]:
    """Split ``value`` along its first dimension over the selected ranks, bound to ``name`` there;
    return rank -> length of its part."""
    targets = _targets(session, ranks)
    parts = split(value, len(targets))
    futures = [(r, session.executor_of(r).set_names.call_one({name: part})) for r, part in zip(targets, parts)]
    _gather_futures(futures, timeout_s)
    return {r: len(part) for r, part in zip(targets, parts)}


def gather(session: Any, name: str, ranks: list[int] | None = None, timeout_s: float | None = None) -> Any:
    """``name`` from each selected rank, joined in rank order (see the module doc)."""
    targets = _targets(session, ranks)
    got = _gather_futures([(r, session.executor_of(r).get_names.call_one([name])) for r in targets], timeout_s)
    return join([_only(got[r])[name] for r in targets])
