"""Worker output on the controller: bytes become lines; %%mesh's router gives each line to its cell."""

from __future__ import annotations

from monarch_nb.jupyter.routing import OutputRouter
from monarch_nb.jupyter.worker import marker_line
from monarch_nb.runtime.output import LineAssembler, OutputLine


def test_lines_are_assembled_across_chunks_and_utf8_edges():
    lines = LineAssembler()
    euro = "€".encode()
    assert lines.feed(("p", "stdout"), b"a\nb" + euro[:1]) == ["a"]
    assert lines.feed(("p", "stdout"), euro[1:] + b"c\n") == ["b€c"]
    assert lines.feed(("p", "stdout"), b"tail") == []
    assert lines.flush(("p", "stdout")) == ["tail"] and lines.flush(("p", "stdout")) == []


class _Run:
    def __init__(self, cell_id: str):
        self.cell_id = cell_id
        self.session = type("S", (), {"mesh_name": "pm0"})()
        self.results = {0: None, 1: None}
        self.lines: list = []
        self.ended: list = []
        self.displays: list = []

    def on_line(self, rank, stream, text, partial=False):
        self.lines.append((rank, stream, text))

    def on_end(self, rank, stream):
        self.ended.append((rank, stream))

    def on_display(self, rank, payload):
        self.displays.append((rank, payload))

    def on_proc_failed(self, rank):
        self.ended.append((rank, "failed"))


def _line(rank: int, text: str, stream: str = "stdout") -> OutputLine:
    return OutputLine("pm0", rank, stream, text)


def test_lines_between_markers_go_to_their_cell_and_the_rest_to_the_fallback():
    fallback: list = []
    router = OutputRouter(fallback.append)
    run = _Run("c1")
    router.register(run)
    mark = lambda kind, payload="": marker_line("c1", kind, payload).decode().rstrip("\n")  # noqa: E731
    router(_line(0, "before"))
    router(_line(0, mark("begin")))
    router(_line(0, "inside"))
    router(_line(0, "half" + mark("display", "e30=")))  # a marker after text on one line
    router(_line(1, "other rank"))
    router(_line(0, mark("end")))
    router(_line(0, "after"))
    assert run.lines == [(0, "stdout", "inside"), (0, "stdout", "half")]
    assert run.displays == [(0, "e30=")] and run.ended == [(0, "stdout")]
    assert [line.text for line in fallback] == ["before", "other rank", "after"]
    router(_line(1, mark("begin")))
    router.on_proc_exit("pm0", 1)
    assert run.ended[-1] == (1, "failed")
