"""Controller side of the debugger: a plain Python API, usable from a script or a notebook.

::

    from monarch_nb.debug import client

    client.debug_targets()                 # paused, failed and dead ranks
    session = client.DebugSession(1)       # pdb on rank 1: its breakpoint, else its last failure
    print(session.banner)
    print(session.command("p x"))
    print(session.command("up"))
    session.command("q")                   # ends a post-mortem session; the rank keeps serving
    client.cast([0, 1], "p x")             # {0: "5\\n", 1: "6\\n"}
    client.continue_all()                  # resume every paused rank
    client.stacks()                        # {rank: text}; client.format_stacks() groups equal ones

Every function takes ``mesh``: a :class:`~monarch_nb.actor.mesh.ProcMesh`, a proc mesh's name,
or None for the newest running mesh. Requests travel as ``debug`` messages to the procs
(:mod:`monarch_nb.debug.worker`) and come back as replies of the controller's messenger, so a
rank that dies while being asked answers with a clear error instead of silence.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import SupervisionError
from ..supervision.records import ProcState
from . import requests
from . import stacks as stacks_mod
from .requests import COMMAND_TIMEOUT_S, QUICK_TIMEOUT_S, DebugError

if TYPE_CHECKING:
    from ..actor.mesh import ProcMesh
    from ..supervision.records import ProcRecord

__all__ = [
    "DebugError",
    "DebugTarget",
    "DebugSession",
    "debug_targets",
    "format_targets",
    "cast",
    "continue_all",
    "wait_paused",
    "clear_failures",
    "stacks",
    "format_stacks",
]

@dataclass
class DebugTarget:
    """Something to debug on a rank (one row of ``%mesh debug``).

    Attributes:
        mesh / rank / coords / pid: where.
        kind: ``"paused"`` (a ``breakpoint()`` holds an actor), ``"failed"`` (an endpoint raised;
            post-mortem possible), ``"dead"`` (the proc is gone, and its failures with it) or
            ``"unreachable"`` (it did not answer: hung or stopped).
        actor / endpoint / function / filename / line: the actor and the code location.
        detail: the exception (``"ValueError: boom"``), or why the rank is dead.
        session / failure: ids on the proc (for :class:`DebugSession`).
    """

    mesh: str
    rank: int
    coords: dict
    pid: int
    kind: str
    actor: str | None = None
    endpoint: str | None = None
    function: str | None = None
    filename: str | None = None
    line: int | None = None
    detail: str = ""
    session: int | None = None
    failure: int | None = None
    extra: dict = field(default_factory=dict)

    def where(self) -> str:
        if not self.function:
            return "-"
        return f"{self.function} ({requests.short_path(self.filename)}:{self.line})"


# -- listing -----------------------------------------------------------------------------------------
def debug_targets(mesh: "ProcMesh | str | None" = None, *, include_all_meshes: bool | None = None,
                  timeout_s: float = QUICK_TIMEOUT_S) -> list[DebugTarget]:
    """Paused, failed, dead and unreachable ranks (ranks with nothing to debug are left out).

    Args:
        mesh: the proc mesh; None: every running mesh.
        timeout_s: how long a rank may take to answer before it is listed as unreachable.

    Raises:
        DebugError: no proc mesh was started, or ``mesh`` is unknown.
    """
    controller = requests.get_controller()
    if mesh is None and include_all_meshes is not False:
        names = [n for n, m in controller.meshes.items() if not m.stopped]
    else:
        names = [requests.resolve_mesh(mesh)]
    targets: list[DebugTarget] = []
    asked = []
    for name in names:
        for rec in requests.mesh_records(name):
            base: dict[str, Any] = dict(mesh=name, rank=rec.rank, coords=dict(rec.coords), pid=rec.pid)
            if rec.state in (ProcState.FAILED, ProcState.STOPPED) or not rec.alive:
                if rec.state == ProcState.FAILED:
                    targets.append(DebugTarget(kind="dead", detail=requests.dead_reason(rec), **base))
                continue
            if rec.state == ProcState.HUNG:
                targets.append(DebugTarget(kind="unreachable", detail="hung (no heartbeat)", **base))
                continue
            asked.append((rec, base, requests.send_request(rec, {"op": "list"})))
    deadline = time.monotonic() + timeout_s
    for _rec, base, future in asked:
        try:
            listing = future.get(max(0.01, deadline - time.monotonic()))
        except SupervisionError as exc:
            targets.append(DebugTarget(kind="dead", detail=str(exc), **base))
            continue
        except TimeoutError:
            targets.append(DebugTarget(kind="unreachable", detail=f"did not answer within {timeout_s} s", **base))
            continue
        base["pid"] = listing.get("pid", base["pid"])
        open_failures = set()
        for s in listing.get("sessions", []):
            if s.get("kind") != "breakpoint":
                open_failures.add(s.get("failure"))
                continue
            targets.append(DebugTarget(
                kind="paused", actor=s.get("actor"), endpoint=s.get("endpoint"), function=s.get("function"),
                filename=s.get("filename"), line=s.get("line"), detail="breakpoint()", session=s.get("session"),
                extra={"state": s.get("state")}, **base,
            ))
        for f in reversed(listing.get("failures", [])):  # newest first
            targets.append(DebugTarget(
                kind="failed", actor=f.get("actor"), endpoint=f.get("endpoint"), function=f.get("function"),
                filename=f.get("filename"), line=f.get("line"), detail=f"{f.get('type')}: {f.get('message')}",
                failure=f.get("failure"), extra={"open": f.get("failure") in open_failures, "time": f.get("time")}, **base,
            ))
    order = {"paused": 0, "failed": 1, "unreachable": 2, "dead": 3}
    targets.sort(key=lambda t: (t.mesh, t.rank, order.get(t.kind, 9), -(t.failure or 0)))
    return targets


def format_targets(targets: list[DebugTarget], *, newest_failure_only: bool = True) -> str:
    """``targets`` as a table: rank, coords, state, actor, endpoint, where (function, file:line), what."""
    if not targets:
        return "nothing to debug: no rank is paused at a breakpoint, has a failure, or died"
    rows = []
    seen_failed: set = set()
    several = len({t.mesh for t in targets}) > 1
    for t in targets:
        if t.kind == "failed" and newest_failure_only:
            if (t.mesh, t.rank) in seen_failed:
                continue
            seen_failed.add((t.mesh, t.rank))
        coords = ",".join(f"{k}={v}" for k, v in t.coords.items()) or "-"
        rank = f"{t.mesh}.{t.rank}" if several else str(t.rank)
        what = t.detail
        if t.kind == "failed" and t.failure is not None:
            what += f"  [failure {t.failure}{', session open' if t.extra.get('open') else ''}]"
        rows.append([rank, coords, t.kind, t.actor or "-", t.endpoint or "-", t.where(), what])
    header = ["rank", "coords", "state", "actor", "endpoint", "where", "what"]
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header) - 1)]
    lines = []
    for row in [header] + rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths)) + "  " + str(row[-1]))
    return "\n".join(lines)


def _rank_record(mesh: str, rank: Any) -> "ProcRecord":
    try:
        return requests.rank_record(mesh, rank)
    except DebugError as exc:
        raise DebugError(f"{exc}. {available_text(mesh)}", None) from None


def available_text(mesh: str | None = None) -> str:
    try:
        targets = [t for t in debug_targets(mesh, include_all_meshes=mesh is None) if t.kind in ("paused", "failed")]
    except DebugError:
        return "Nothing can be debugged."
    if not targets:
        return "No rank is paused or has a failure to debug."
    seen = []
    for t in targets:
        entry = f"rank {t.rank} ({'paused in' if t.kind == 'paused' else 'failed in'} {t.where()})"
        if entry not in seen:
            seen.append(entry)
    return "Available: " + ", ".join(seen) + "."


# -- sessions ----------------------------------------------------------------------------------------
class DebugSession:
    """pdb on one rank, one command at a time.

    Attaches to the rank's paused ``breakpoint()`` if it has one, else to its open post-mortem
    session, else starts post-mortem on its newest failure (or on ``failure``).

    Args:
        rank: flat rank in the proc mesh.
        mesh: the proc mesh (ProcMesh, name, or None for the newest running one).
        failure: a failure id from :func:`debug_targets` (post-mortem of an older failure).
        session: a session id (attach to that one).
        timeout_s: how long one command may run before :meth:`command` returns "still running".

    Attributes:
        banner: what pdb printed on attach (where, device, the current line).
        prompt: pdb's prompt now (``"(Pdb) "``, ``">>> "`` inside ``interact``), "" once ended.
        ended: True once the session ended (``q`` / ``c`` post-mortem, ``c`` at a breakpoint).

    Raises:
        DebugError: unknown rank, dead rank, or nothing to debug there (the message lists what is).
    """

    def __init__(self, rank: int, mesh: "ProcMesh | str | None" = None, *, failure: int | None = None,
                 session: int | None = None, timeout_s: float = COMMAND_TIMEOUT_S):
        self.mesh = requests.resolve_mesh(mesh)
        self.record = _rank_record(self.mesh, rank)
        self.rank = rank
        self.timeout_s = timeout_s
        self._waiting = None
        reply = self._attach_reply(self.record, failure, session)
        self.id: int = reply["session"]
        self.banner: str = reply.get("output", "")
        self.prompt: str = reply.get("prompt", "")
        self.ended: bool = reply.get("state") == "ended"

    def _attach_reply(self, rec: "ProcRecord", failure: int | None, session: int | None) -> dict:
        try:
            reply = requests.ask(rec, {"op": "attach", "failure": failure, "session": session, "sources": requests.cell_sources()})
        except DebugError as exc:
            raise DebugError(f"{exc}. {available_text(self.mesh)}", rec.rank) from None
        if "error" in reply:
            raise DebugError(f"rank {rec.rank}: {reply['error']}. {available_text(self.mesh)}", rec.rank)
        return reply

    def command(self, line: str, timeout_s: float | None = None) -> str:
        """Run one pdb command (``"p x"``, ``"up"``, ``"l"``, ``"c"``...) on the rank; return its output.

        If the command runs longer than ``timeout_s`` (``n`` over a long call), the text says so and
        its output is returned by the next call instead.

        Raises:
            DebugError: the session has ended, or the rank died.
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        prefix = ""
        if self._waiting is not None:
            done, prefix = self._collect(self._waiting, timeout_s)
            if not done:
                return prefix
            self._waiting = None
        if self.ended:
            raise DebugError(f"the debug session on rank {self.rank} has ended; %mesh debug lists what is left", self.rank)
        if not self.record.alive:
            self.ended = True
            raise DebugError(f"rank {self.rank} died: {requests.dead_reason(self.record)}", self.rank)
        future = requests.send_request(self.record, {"op": "cmd", "session": self.id, "line": line})
        done, text = self._collect(future, timeout_s)
        if not done:
            self._waiting = future
        return prefix + text

    def _collect(self, future, timeout_s: float) -> tuple[bool, str]:
        try:
            error = future.exception(timeout_s)
        except TimeoutError:
            return False, (f"(rank {self.rank} is still running the command after {timeout_s:g} s; "
                           "its output comes with your next command)\n")
        if error is not None:
            self.ended = True
            if isinstance(error, SupervisionError):
                raise DebugError(f"rank {self.rank} died while debugging: {error}", self.rank) from None
            raise error
        reply = future.get()
        if "error" in reply:
            self.ended = True
            return True, f"({reply['error']})\n"
        self.prompt = reply.get("prompt", "")
        self.ended = reply.get("state") == "ended"
        return True, reply.get("output", "")

    def __repr__(self) -> str:
        state = "ended" if self.ended else "open"
        return f"<DebugSession rank {self.rank} of {self.mesh!r}, session {self.id}, {state}>"


def _sessions_for(ranks: Iterable[int], mesh: str, *, paused_only: bool) -> dict[int, list[int]]:
    """rank -> session ids to address (paused breakpoints; else, unless ``paused_only``, a
    post-mortem session on the newest failure)."""
    out: dict[int, list[int]] = {}
    for rank in ranks:
        rec = _rank_record(mesh, rank)
        try:
            listing = requests.ask(rec, {"op": "list"})
        except DebugError:
            continue
        paused = [s["session"] for s in listing.get("sessions", []) if s.get("kind") == "breakpoint"]
        if paused:
            out[rank] = paused
        elif not paused_only:
            opened = [s["session"] for s in listing.get("sessions", [])]
            if opened or listing.get("failures"):
                out[rank] = opened[:1] or [-1]  # -1: start post-mortem on attach
    return out


def cast(ranks: Iterable[int] | None, line: str, mesh: "ProcMesh | str | None" = None,
         timeout_s: float = COMMAND_TIMEOUT_S) -> dict[int, str]:
    """Run one pdb command on several ranks at once; ``{rank: output}``, by rank.

    Each rank's paused breakpoint gets the command (or, if it has none, a post-mortem session on
    its newest failure). Ranks with nothing to debug answer with a note saying so.

    Args:
        ranks: flat ranks; None: every rank that is paused or failed.

    Raises:
        DebugError: an unknown rank, or no rank at all can be debugged.
    """
    name = requests.resolve_mesh(mesh)
    all_ranks = [r.rank for r in requests.mesh_records(name)]
    chosen = sorted(set(all_ranks if ranks is None else ranks))
    for rank in chosen:
        _rank_record(name, rank)
    targets = _sessions_for(chosen, name, paused_only=False)
    if not targets:
        raise DebugError(f"none of ranks {chosen} has a breakpoint or a failure to debug. {available_text(name)}")
    out: dict[int, str] = {}

    def run(rank: int) -> tuple[int, str]:
        texts = []
        for sid in targets[rank]:
            try:
                session = DebugSession(rank, name, session=None if sid == -1 else sid, timeout_s=timeout_s)
                texts.append(session.command(line))
            except DebugError as exc:
                texts.append(f"({exc})\n")
        return rank, "".join(texts)

    with ThreadPoolExecutor(max_workers=max(1, min(16, len(targets)))) as pool:
        for rank, text in pool.map(run, sorted(targets)):
            out[rank] = text
    for rank in chosen:
        rec = _rank_record(name, rank)
        note = "nothing to debug on this rank" if rec.alive else f"dead: {requests.dead_reason(rec)}"
        out.setdefault(rank, f"({note})\n")
    return dict(sorted(out.items()))


def continue_all(mesh: "ProcMesh | str | None" = None, timeout_s: float = QUICK_TIMEOUT_S) -> dict[int, str]:
    """Resume every paused ``breakpoint()`` of the mesh; ``{rank: pdb's last words}``.

    Raises:
        DebugError: no proc mesh, or an unknown mesh.
    """
    name = requests.resolve_mesh(mesh)
    targets = _sessions_for([r.rank for r in requests.mesh_records(name) if r.alive], name, paused_only=True)
    out: dict[int, str] = {}
    for rank, sids in sorted(targets.items()):
        rec = _rank_record(name, rank)
        texts = []
        for sid in sids:
            try:
                reply = requests.ask(rec, {"op": "cmd", "session": sid, "line": "c"}, timeout_s)
                texts.append(reply.get("output") or f"({reply.get('error')})\n")
            except DebugError as exc:
                texts.append(f"({exc})\n")
        out[rank] = "".join(texts)
    return out


def wait_paused(count: int = 1, mesh: "ProcMesh | str | None" = None, timeout_s: float = 30.0) -> list[DebugTarget]:
    """Block until ``count`` ranks of the mesh are paused at a ``breakpoint()``; return them.

    For scripts and unattended notebooks that start a call without waiting for it (``fut =
    actors.step.call()``) and then debug it.

    Raises:
        TimeoutError: fewer than ``count`` ranks paused within ``timeout_s`` (the message says how many did).
        DebugError: no proc mesh, or an unknown mesh.
    """
    name = requests.resolve_mesh(mesh)
    deadline = time.monotonic() + timeout_s
    while True:
        paused = [r for r in requests.mesh_records(name) if r.paused]
        if len(paused) >= count:
            return [t for t in debug_targets(name, include_all_meshes=False) if t.kind == "paused"]
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(paused)} of the {count} rank(s) waited for paused within {timeout_s} s")
        time.sleep(0.02)


def clear_failures(mesh: "ProcMesh | str | None" = None, ranks: Iterable[int] | None = None) -> dict[int, int]:
    """Forget the kept failures (and the memory their frames hold); ``{rank: how many}``."""
    name = requests.resolve_mesh(mesh)
    chosen = [r.rank for r in requests.mesh_records(name)] if ranks is None else list(ranks)
    out = {}
    for rank in chosen:
        rec = _rank_record(name, rank)
        if rec.alive and rec.state != ProcState.HUNG:
            out[rank] = requests.ask(rec, {"op": "clear"}).get("cleared", 0)
    return out


# -- stacks -------------------------------------------------------------------------------------------
def stack_data(mesh: "ProcMesh | str | None" = None, ranks: Iterable[int] | None = None,
               timeout_s: float = 1.0) -> dict[int, dict]:
    """Raw stacks by rank (see :mod:`monarch_nb.debug.stacks`): asked over the channel, and
    through SIGUSR1 + faulthandler for a rank whose IO thread does not answer in ``timeout_s``;
    for a rank fenced after a hang and not restarted, the stacks its host agent took just before
    the SIGKILL (``"kept"`` says so).

    Raises:
        DebugError: no proc mesh, an unknown mesh or rank.
    """
    name = requests.resolve_mesh(mesh)
    records = requests.mesh_records(name)
    chosen = [r.rank for r in records] if ranks is None else list(ranks)
    asked = {}
    out: dict[int, dict] = {}
    for rank in chosen:
        rec = _rank_record(name, rank)
        if not rec.alive and rec.hung_stacks is not None and rec.hung_stacks.get("pid") == rec.pid:
            out[rank] = {**rec.hung_stacks, "kept": f"rank {rank} is dead ({requests.dead_reason(rec)}): "
                                                    "its stacks when it was judged hung, just before it was fenced"}
        elif not rec.alive:
            out[rank] = {"pid": rec.pid, "source": "none", "why": f"rank {rank} is dead: {requests.dead_reason(rec)}"}
        elif rec.state == ProcState.HUNG or rec.pid == 0:
            out[rank] = stacks_mod.dump_with_signal(rec.pid) if rec.pid else {"pid": 0, "source": "none", "why": "not started"}
        else:
            asked[rank] = requests.send_request(rec, {"op": "stack"})
    deadline = time.monotonic() + timeout_s
    for rank, future in asked.items():
        rec = records[rank]
        try:
            out[rank] = future.get(max(0.01, deadline - time.monotonic()))
        except (SupervisionError, TimeoutError) as exc:  # no answer: ask the process itself
            if rec.alive and rec.pid:
                out[rank] = stacks_mod.dump_with_signal(rec.pid)
            else:
                out[rank] = {"pid": rec.pid, "source": "none", "why": f"rank {rank} is dead: {exc}"}
    return dict(sorted(out.items()))


def stacks(mesh: "ProcMesh | str | None" = None, ranks: Iterable[int] | None = None, timeout_s: float = 1.0) -> dict[int, str]:
    """The live Python stack of every thread of each rank, as text: ``{rank: text}``.

    Raises:
        DebugError: no proc mesh, an unknown mesh or rank.
    """
    return {rank: stacks_mod.format_stack(data) for rank, data in stack_data(mesh, ranks, timeout_s).items()}


def format_stacks(mesh: "ProcMesh | str | None" = None, ranks: Iterable[int] | None = None, timeout_s: float = 1.0) -> str:
    """Stacks of ``ranks`` as one text; ranks whose stacks read the same are shown once, together.

    Raises:
        DebugError: no proc mesh, an unknown mesh or rank.
    """
    name = requests.resolve_mesh(mesh)
    data = stack_data(name, ranks, timeout_s)
    records = requests.mesh_records(name)
    if len(data) == 1:
        rank, one = next(iter(data.items()))
        return _rank_title(records[rank], one) + "\n" + stacks_mod.format_stack(one)
    texts = {rank: stacks_mod.format_stack(d, times=False) for rank, d in data.items()}
    parts = []
    for ranks_in_group, text in stacks_mod.group_identical(texts):
        if len(ranks_in_group) == 1:
            title = _rank_title(records[ranks_in_group[0]], data[ranks_in_group[0]])
        else:
            title = f"ranks {_ranks_text(ranks_in_group)} ({len(ranks_in_group)} ranks, identical stacks):"
        parts.append(title + "\n" + text)
    return "\n\n".join(parts)


def _rank_title(rec: "ProcRecord", data: dict) -> str:
    coords = ", ".join(f"{k}={v}" for k, v in rec.coords.items())
    facts = [f"pid {data.get('pid') or rec.pid}", rec.state]
    if rec.paused:
        facts.append("paused in the debugger")
    return f"rank {rec.rank}" + (f" ({coords})" if coords else "") + f" [{', '.join(facts)}]:"


def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs)
