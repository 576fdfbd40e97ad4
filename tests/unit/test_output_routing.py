"""Worker output on the controller: bytes become lines; %%mesh's router gives each line to its cell."""

from __future__ import annotations

import io
import sys

from monarch_nb.jupyter.routing import OutputRouter
from monarch_nb.jupyter.worker import marker_line
from monarch_nb.runtime.output import LineAssembler, LiveLines, OutputLine, deliver


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


def test_a_carriage_return_hands_out_the_unfinished_line_at_once():
    lines = LineAssembler(quiet_s=0.1)
    key = ("p", "stderr")
    assert lines.feed(key, b"\r 10%|#", now=0.0) == []
    assert lines.redrawn(key) == " 10%|#" and lines.redrawn(key) is None  # handed out once
    assert lines.feed(key, b"\r 20%|##", now=0.01) == [] and lines.redrawn(key) == " 20%|##"
    assert lines.quiet(now=5.0) == []  # already shown: nothing more after the quiet period
    assert lines.feed(key, b"\r100%|###\n", now=0.02) == ["100%|###"]  # the line as a terminal shows it
    assert lines.redrawn(key) is None


def test_an_unfinished_line_is_handed_out_after_a_quiet_period_only():
    lines = LineAssembler(quiet_s=0.1)
    key = ("p", "stdout")
    assert lines.feed(key, b"loading", now=0.0) == [] and lines.redrawn(key) is None
    assert lines.quiet(now=0.05) == []  # still being written (print writes its pieces one by one)
    assert lines.feed(key, b"...", now=0.06) == []
    assert lines.quiet(now=0.1) == []
    assert lines.quiet(now=0.2) == [(key, "loading...")] and lines.quiet(now=9.0) == []
    assert lines.feed(key, b" done\nnext", now=0.3) == ["loading... done"]
    assert lines.flush(key) == ["next"]


def test_records_and_blank_lines_are_never_partial():
    lines = LineAssembler(quiet_s=0.0)
    key = ("p", "stdout")
    lines.feed(key, b"\x1emnb:abc:be", now=0.0)  # a marker cut by a chunk edge
    assert lines.quiet(now=1.0) == [] and lines.redrawn(key) is None
    assert lines.feed(key, b"gin\x1e\n", now=0.0) == ["\x1emnb:abc:begin\x1e"]
    lines.feed(key, b"\r   \r", now=0.0)
    assert lines.redrawn(key) is None and lines.quiet(now=1.0) == []


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_redraws_one_line_per_rank_in_place(monkeypatch):
    term = _Tty()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", term)
    live = LiveLines()
    for pct in (10, 20, 30):
        for rank in (0, 1):
            live.show(OutputLine("m", rank, "stderr", f"{pct}%", partial=True), f"[{rank}] {pct}%")
    live.show(OutputLine("m", 0, "stdout", "hello"), "[0] hello")
    screen = _render(term.getvalue())
    assert screen == ["[0] hello", "[0] 30%", "[1] 30%"], screen


def test_partial_lines_go_only_to_sinks_that_take_them():
    got, whole = [], []

    def taker(line):
        got.append(line)

    taker.accepts_partial = True
    deliver([taker, whole.append], OutputLine("m", 0, "stdout", "50%", partial=True), on_error=print)
    deliver([taker, whole.append], OutputLine("m", 0, "stdout", "done"), on_error=print)
    assert [line.text for line in got] == ["50%", "done"] and [line.text for line in whole] == ["done"]


def _render(text: str) -> list[str]:
    """What a terminal shows for ``text`` (newlines, ESC[nF: up n lines, ESC[J: clear below)."""
    screen: list[str] = [""]
    row = 0
    i = 0
    while i < len(text):
        if text.startswith("\x1b[", i):
            j = i + 2
            while not text[j].isalpha():
                j += 1
            arg, cmd = text[i + 2:j], text[j]
            if cmd == "F":
                row = max(0, row - int(arg or 1))
                screen[row] = screen[row] if row < len(screen) else ""
            elif cmd == "J":
                del screen[row + 1:]
                screen[row] = ""
            i = j + 1
            continue
        ch = text[i]
        if ch == "\n":
            row += 1
            if row == len(screen):
                screen.append("")
        else:
            screen[row] += ch
        i += 1
    return [line for line in screen if line]


def test_a_cells_last_line_is_shown_when_it_comes_just_as_the_pump_stops_waiting(capsys):
    """The race of a loaded machine: the pump's wait for output times out, and before it looks at
    whether the run is done, the last rank's last line and the run's end arrive. The line is shown."""
    import queue

    from monarch_nb.jupyter.cells import CellRun

    run = CellRun(session=None, source="print('finished', rank)", ranks=[0, 1])

    class _LateQueue(queue.SimpleQueue):
        timed_out = False

        def get(self, block=True, timeout=None):
            if timeout is not None and not self.timed_out:
                self.timed_out = True
                self.put(("line", 1, "stdout", "finished 1"))
                self.put(("done",))
                run._done.set()
                raise queue.Empty
            return super().get(block, timeout)

    run._queue = _LateQueue()
    run._queue.put(("line", 0, "stdout", "finished 0"))
    run.pump()
    out = capsys.readouterr().out
    assert "[stdout:0] finished 0" in out and "[stdout:1] finished 1" in out, out
