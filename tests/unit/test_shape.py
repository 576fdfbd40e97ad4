"""Mesh geometry: Extent, Point and Shape slicing, as Monarch lays ranks out (row-major)."""

from __future__ import annotations

import pickle

import pytest

from monarch_nb.actor.shape import Extent, Point, Shape


def test_ranks_are_row_major_over_the_dims():
    extent = Extent({"hosts": 2, "gpus": 4})
    assert extent.nelements == 8 and extent.labels == ["hosts", "gpus"]
    point = extent.point(6)
    assert dict(point) == {"hosts": 1, "gpus": 2} and point.rank == 6
    assert [p.rank for p in extent.points()] == list(range(8))
    assert pickle.loads(pickle.dumps(point)) == point


def test_an_int_drops_the_dim_and_a_slice_keeps_it():
    shape = Shape(Extent({"hosts": 2, "gpus": 4}))
    one_host = shape.slice(hosts=1)
    assert dict(one_host.extent) == {"gpus": 4} and one_host.ranks == [4, 5, 6, 7]
    evens = one_host.slice(gpus=slice(0, None, 2))
    assert dict(evens.extent) == {"gpus": 2} and evens.ranks == [4, 6]  # a slice of a slice knows its procs
    assert shape.slice(gpus=-1).ranks == [3, 7]
    assert shape.flatten("all").ranks == list(range(8))


@pytest.mark.parametrize("selection, message", [
    ({"cpus": 0}, r"unknown dim\(s\) \['cpus'\]; this mesh has dims \['hosts', 'gpus'\]"),
    ({"gpus": 4}, r"index 4 out of range 0\.\.3"),
    ({"gpus": slice(5, 9)}, "selects nothing"),
    ({"gpus": "0"}, "select with an int or a slice"),
])
def test_bad_selections_name_the_valid_range(selection, message):
    with pytest.raises(ValueError, match=message):
        Shape(Extent({"hosts": 2, "gpus": 4})).slice(**selection)


@pytest.mark.parametrize("dims", [{"gpus": 0}, {"gpus": 1.5}, {"bad name": 2}])
def test_bad_extents_are_refused(dims):
    with pytest.raises(ValueError):
        Extent(dims)


def test_point_selects_its_member():
    extent = Extent({"gpus": 4})
    point = Point({"gpus": 2}, 2, extent)
    assert Shape(extent).slice(**point).ranks == [2]
