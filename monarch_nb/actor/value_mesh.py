"""ValueMesh: one value per member of a mesh, with the mesh's dims (what ``call`` returns)."""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

from .shape import Extent, Point

__all__ = ["ValueMesh"]

R = TypeVar("R")


class ValueMesh(Generic[R]):
    """Values laid out over an extent in row-major order.

    ``vm.item(gpus=2)`` reads one value; ``vm.items()`` yields ``(Point, value)``; ``vm.values()``
    lists them in rank order.
    """

    def __init__(self, extent: Extent, values: list[R]):
        if len(values) != extent.nelements:
            raise ValueError(f"{len(values)} values for an extent of {extent.nelements}")
        self.extent = extent
        self._values = list(values)

    def item(self, **coords: int) -> R:
        """The value at ``coords`` (every dim of the extent must be given).

        Raises:
            KeyError: a dim is missing or unknown, or an index is out of range.
        """
        if set(coords) != set(self.extent):
            raise KeyError(f"give every dim exactly: {self.extent.labels}, got {sorted(coords)}")
        rank = 0
        for name, size in self.extent.items():
            index = coords[name]
            if not 0 <= index < size:
                raise KeyError(f"dim {name!r} index {index} out of range 0..{size - 1}")
            rank = rank * size + index
        return self._values[rank]

    def items(self) -> Iterator[tuple[Point, R]]:
        return zip(self.extent.points(), self._values)

    def values(self) -> list[R]:
        return list(self._values)

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueMesh) and dict(self.extent) == dict(other.extent) and self._values == other._values

    def __repr__(self) -> str:
        if not len(self.extent):
            return f"ValueMesh({self._values[0]!r})"
        body = ", ".join(f"({', '.join(f'{k}={i}' for k, i in p.items())}): {v!r}" for p, v in self.items())
        return f"ValueMesh({dict(self.extent)}, {{{body}}})"
