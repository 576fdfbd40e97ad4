"""A notebook session driven from Python, no kernel: values that travel without copies, and
``wait_interactive`` in a terminal."""

from __future__ import annotations

import io

import pytest

from monarch_nb.jupyter.session import MeshSession
from monarch_nb.jupyter.values import join, split

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def session(procs4):
    return MeshSession(procs4, owned=False)


def test_a_64_mib_tensor_is_pushed_without_a_copy_into_the_pickle_stream(session, monkeypatch):
    import torch

    from monarch_nb.runtime import messenger

    bodies: list[int] = []
    buffers: list[int] = []
    real_dumps = messenger.dumps

    def recording_dumps(obj):
        body, bufs = real_dumps(obj)
        bodies.append(len(body))
        buffers.append(sum(memoryview(b).nbytes for b in bufs))
        return body, bufs

    monkeypatch.setattr(messenger, "dumps", recording_dumps)
    big = torch.arange(16 * 1024 * 1024, dtype=torch.float32)  # 64 MiB
    assert session.procs.push(big=big, timeout_s=60) == [0, 1, 2, 3]
    assert max(bodies) < 64 * 1024, bodies  # the stream holds the header, not the data
    assert max(buffers) >= big.numel() * 4
    monkeypatch.setattr(messenger, "dumps", real_dumps)
    run = session.run_cell("total = float(big.double().sum()); shape = tuple(big.shape)", [0, 1, 2, 3])
    assert run.wait(60) and not run.errors
    assert session.procs.pull("total").values() == [float(big.double().sum())] * 4
    assert session.procs.pull("shape", ranks=[2]) == {2: (16 * 1024 * 1024,)}


def test_wait_interactive_in_a_terminal(session):
    run = session.run_cell("import time\ntime.sleep(0.2 * rank)", [0, 1, 2, 3])
    out = io.StringIO()
    assert run.wait_interactive(timeout=60, file=out) is True
    text = out.getvalue()
    assert "4/4" in text and "rank" in text, text
    assert run.done() and not run.errors
    late = session.run_cell("import time\ntime.sleep(30)", [1])
    assert late.wait_interactive(timeout=0.3, file=io.StringIO()) is False  # gave up, still running
    late.interrupt()
    assert late.wait(10)


def test_barrier_and_its_timeout(session):
    session.run_cell("import time\ntime.sleep(1.0)", [3])
    with pytest.raises(TimeoutError):
        session.barrier(timeout_s=0.2)
    assert session.barrier(timeout_s=30) >= 0.0
    assert not session.running()


@pytest.mark.parametrize("value, parts, sizes", [
    (list(range(10)), 4, [3, 3, 2, 2]),
    ("abcde", 2, [3, 2]),
    (tuple(range(3)), 4, [1, 1, 1, 0]),
])
def test_split_and_join_are_inverse(value, parts, sizes):
    pieces = split(value, parts)
    assert [len(p) for p in pieces] == sizes
    assert join(pieces) == value


def test_split_refuses_what_has_no_first_dimension():
    with pytest.raises(TypeError, match="scatter needs a sequence"):
        split(7, 2)
    with pytest.raises(TypeError, match="scatter needs a sequence"):
        split({"a": 1}, 2)
    assert join([1, 2]) == [1, 2]  # scalars: a list of the ranks' values
