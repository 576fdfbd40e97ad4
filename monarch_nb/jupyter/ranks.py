"""Which ranks a ``%%mesh`` cell or a ``%mesh`` subcommand acts on: ``--ranks`` specs and their text."""

from __future__ import annotations

import re

from ..errors import format_ranks as _format_ranks

__all__ = ["RANK_FORMS", "RankSpecError", "parse_ranks", "format_ranks"]


class RankSpecError(ValueError):
    """A malformed or out-of-range ``--ranks`` value."""


RANK_FORMS = "all | N | A-B (inclusive) | A:B[:STEP] (a Python slice) | a comma-separated mix, e.g. 0,2-3"


def parse_ranks(spec: str | None, world_size: int) -> list[int]:
    """The sorted ranks that ``spec`` selects out of ``0..world_size-1``.

    >>> parse_ranks("0,2-3", 4)
    [0, 2, 3]
    >>> parse_ranks("::2", 4)
    [0, 2]

    Raises:
        RankSpecError: a malformed spec or a rank out of range (the message names the valid forms).
    """
    if spec is None or spec.strip() in ("", "all", "*"):
        return list(range(world_size))
    chosen: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if ":" in part:
                pieces = [int(p) if p.strip() else None for p in part.split(":")]
                if len(pieces) > 3:
                    raise ValueError(part)
                if any(p is not None and p < 0 for p in pieces):
                    raise RankSpecError(f"--ranks {spec!r}: negative numbers are not ranks; valid ranks are 0..{world_size - 1}")
                if len(pieces) == 3 and pieces[2] == 0:
                    raise ValueError(part)
                stop = pieces[1]
                if stop is not None and stop > world_size:
                    raise RankSpecError(f"--ranks {spec!r}: {stop} is past the last rank; valid ranks are 0..{world_size - 1}")
                picked = list(range(world_size))[slice(*pieces)]
            elif re.fullmatch(r"\d+\s*-\s*\d+", part):
                lo, hi = (int(p) for p in part.split("-"))
                if lo > hi:
                    raise RankSpecError(f"--ranks {spec!r}: range {part} runs backwards (write {hi}-{lo})")
                picked = list(range(lo, hi + 1))
            else:
                picked = [int(part)]
        except RankSpecError:
            raise
        except ValueError:
            raise RankSpecError(f"--ranks {spec!r} is malformed; valid forms: {RANK_FORMS}") from None
        bad = [r for r in picked if not 0 <= r < world_size]
        if bad:
            raise RankSpecError(f"--ranks {spec!r}: rank {bad[0]} is out of range; valid ranks are 0..{world_size - 1}")
        chosen.update(picked)
    if not chosen:
        raise RankSpecError(f"--ranks {spec!r} selects no rank; valid ranks are 0..{world_size - 1}")
    return sorted(chosen)


def format_ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    return _format_ranks(ranks)
