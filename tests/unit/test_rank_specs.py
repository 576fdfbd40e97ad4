"""``--ranks`` forms of ``%%mesh`` and ``%mesh debug`` (no kernel needed)."""

from __future__ import annotations

import pytest

from monarch_nb.jupyter.ranks import RankSpecError, format_ranks, parse_ranks


def test_parse_ranks_forms():
    assert parse_ranks(None, 4) == [0, 1, 2, 3]
    assert parse_ranks("all", 4) == [0, 1, 2, 3]
    assert parse_ranks("2", 4) == [2]
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    assert parse_ranks("1:", 4) == [1, 2, 3]
    assert parse_ranks("::2", 8) == [0, 2, 4, 6]
    for bad in ("x", "1-", "3-1", "-1", "0:9", "4", "1::0", ""):
        if bad == "":
            continue
        with pytest.raises(RankSpecError, match=r"valid|backwards"):
            parse_ranks(bad, 4)
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


