"""ValueMesh: one value per member of a mesh, with the mesh's dims (what ``call`` returns)."""

from __future__ import annotations

from typing import Any, Generic, Iterator, TypeVar

from .shape import Extent, Point, Shape

__all__ = ["ValueMesh"]

R = TypeVar("R")


class ValueMesh(Generic[R]):
    """Values laid out over an extent in row-major order.

    ``vm.item(gpus=2)`` reads one value; ``vm.items()`` (and iteration) yields ``(Point, value)``;
    ``vm.values()`` lists them in rank order; ``vm.slice(gpus=1)`` and ``vm.flatten("r")`` give
    ValueMeshes over part of it or over one dim, as for every mesh.
    """

    def __init__(self, extent: Extent, values: list[R], _shape: Shape | None = None):
        if _shape is None:
            if len(values) != extent.nelements:
                raise ValueError(f"{len(values)} values for an extent of {extent.nelements}")
            _shape = Shape(extent)
        self._shape = _shape
        self._all = values

    @property
    def extent(self) -> Extent:
        return self._shape.extent

    @property
    def _values(self) -> list[R]:
        return [self._all[r] for r in self._shape.ranks]

    def item(self, **coords: int) -> R:
        """The value at ``coords`` (every dim of the extent must be given; none for a mesh of one).

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
        return self._all[self._shape.ranks[rank]]

    def get(self, rank: int) -> R:
        """The value at flat ``rank`` of this mesh.

        Raises:
            ValueError: ``rank`` out of range.
        """
        if not 0 <= rank < len(self._shape):
            raise ValueError(f"index {rank} out of range 0..{len(self._shape) - 1}")
        return self._all[self._shape.ranks[rank]]

    def items(self) -> Iterator[tuple[Point, R]]:
        return zip(self.extent.points(), self._values)

    def values(self) -> list[R]:
        return self._values

    def slice(self, **selection: int | slice) -> "ValueMesh[R]":
        """The values at ``selection`` (an int drops the dim, a ``slice`` keeps it)."""
        return ValueMesh(self.extent, self._all, self._shape.slice(**selection))

    def flatten(self, name: str) -> "ValueMesh[R]":
        """The same values along one dim called ``name``."""
        return ValueMesh(self.extent, self._all, self._shape.flatten(name))

    def size(self, dim: str | None = None) -> int:
        return len(self._shape) if dim is None else self.extent[dim]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.extent)

    def __iter__(self) -> Iterator[tuple[Point, R]]:
        return self.items()

    def __len__(self) -> int:
        return len(self._shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ValueMesh) and dict(self.extent) == dict(other.extent) and self._values == other._values

    def __reduce__(self) -> tuple[Any, ...]:
        return ValueMesh, (self.extent, self._values)

    def __repr__(self) -> str:
        values = self._values
        if not len(self.extent):
            return f"ValueMesh({values[0]!r})"
        body = ", ".join(f"({', '.join(f'{k}={i}' for k, i in p.items())}): {v!r}" for p, v in zip(self.extent.points(), values))
        return f"ValueMesh({dict(self.extent)}, {{{body}}})"
