"""Mesh geometry: Extent (named dims and sizes), Point (a coordinate), Shape (a slice of ranks).

Ranks are row-major over the dims, as in Monarch: for ``{"hosts": 2, "gpus": 4}`` the proc at
``hosts=1, gpus=2`` has rank 6. A :class:`Shape` is a view: an extent plus the global ranks of
its members in row-major order, so a slice of a slice still knows which procs it covers.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, Iterator

__all__ = ["Extent", "Point", "Shape"]


class Extent(Mapping[str, int]):
    """An ordered mapping of dim name -> size, e.g. ``Extent({"hosts": 2, "gpus": 4})``."""

    __slots__ = ("_dims",)

    def __init__(self, dims: Mapping[str, int] | None = None):
        dims = dict(dims or {})
        for name, size in dims.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"dim name {name!r} must be an identifier such as 'gpus'")
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"dim {name!r} must have a positive integer size, got {size!r}")
        self._dims = dims

    def __getitem__(self, name: str) -> int:
        return self._dims[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    @property
    def labels(self) -> list[str]:
        return list(self._dims)

    @property
    def sizes(self) -> list[int]:
        return list(self._dims.values())

    @property
    def nelements(self) -> int:
        return math.prod(self._dims.values())

    def points(self) -> Iterator["Point"]:
        """All points in row-major order."""
        for rank, coords in enumerate(itertools.product(*(range(s) for s in self.sizes))):
            yield Point(dict(zip(self.labels, coords)), rank, self)

    def point(self, rank: int) -> "Point":
        coords = {}
        rest = rank
        for name, size in reversed(list(self._dims.items())):
            coords[name] = rest % size
            rest //= size
        return Point(dict(reversed(list(coords.items()))), rank, self)

    def __repr__(self) -> str:
        return f"Extent({self._dims})"

    def __reduce__(self) -> tuple[Any, ...]:
        return Extent, (self._dims,)


class Point(Mapping[str, int]):
    """A coordinate in an extent: a mapping dim -> index, with ``.rank`` the flat row-major rank.

    ``mesh.slice(**point)`` selects the member at this point.
    """

    __slots__ = ("_coords", "rank", "extent")

    def __init__(self, coords: Mapping[str, int], rank: int, extent: Extent):
        self._coords = dict(coords)
        self.rank = rank
        self.extent = extent

    def __getitem__(self, name: str) -> int:
        return self._coords[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __repr__(self) -> str:
        """As Monarch prints a Point: ``{'hosts': 0/1, 'gpus': 1/2}`` (index/size per dim)."""
        inner = ", ".join(f"{k!r}: {v}/{self.extent[k] if k in self.extent else '?'}" for k, v in self._coords.items())
        return "{" + inner + "}"

    def size(self, label: str) -> int:
        """The size of dim ``label`` of this Point's extent."""
        return self.extent[label]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._coords == other._coords and self.rank == other.rank
        return Mapping.__eq__(self, other)

    def __hash__(self) -> int:
        return hash((tuple(self._coords.items()), self.rank))

    def __reduce__(self) -> tuple[Any, ...]:
        return Point, (self._coords, self.rank, self.extent)


class Shape:
    """An extent whose members map to global ranks (indices into the root proc mesh)."""

    __slots__ = ("extent", "ranks")

    def __init__(self, extent: Extent, ranks: list[int] | None = None):
        self.extent = extent
        self.ranks = list(range(extent.nelements)) if ranks is None else list(ranks)
        if len(self.ranks) != extent.nelements:
            raise ValueError("a shape needs one global rank per point")

    def __len__(self) -> int:
        return len(self.ranks)

    def slice(self, **selection: int | slice) -> "Shape":
        """Select along dims: an int picks one index and drops the dim, a ``slice`` keeps it.

        Raises:
            ValueError: an unknown dim, or an index out of range (the message names the valid range).
        """
        unknown = set(selection) - set(self.extent)
        if unknown:
            raise ValueError(f"unknown dim(s) {sorted(unknown)}; this mesh has dims {self.extent.labels}")
        per_dim: list[list[int]] = []
        new_dims: dict[str, int] = {}
        for name, size in self.extent.items():
            sel = selection.get(name, slice(None))
            if isinstance(sel, bool) or not isinstance(sel, (int, slice)):
                raise ValueError(f"dim {name!r}: select with an int or a slice, got {sel!r}")
            if isinstance(sel, int):
                index = sel + size if sel < 0 else sel
                if not 0 <= index < size:
                    raise ValueError(f"dim {name!r} index {sel} out of range 0..{size - 1}")
                per_dim.append([index])
            else:
                indices = list(range(size))[sel]
                if not indices:
                    raise ValueError(f"dim {name!r} slice {sel} selects nothing (size {size})")
                per_dim.append(indices)
                new_dims[name] = len(indices)
        strides = [math.prod(self.extent.sizes[i + 1 :]) for i in range(len(self.extent))]
        ranks = [
            self.ranks[sum(i * s for i, s in zip(coords, strides))] for coords in itertools.product(*per_dim)
        ]
        return Shape(Extent(new_dims), ranks)

    def flatten(self, name: str) -> "Shape":
        return Shape(Extent({name: len(self.ranks)}), self.ranks)

    def __repr__(self) -> str:
        return f"Shape({dict(self.extent)}, ranks={self.ranks})"
