"""``%mesh debug`` and ``%mesh stack``: debug failed, paused and hung ranks in the notebook cell.

The ``%mesh`` magic (:mod:`monarch_nb.jupyter.magics`) delegates here:

``%mesh debug``
    list paused and failed ranks (actor, rank, coordinates, function, line), then take debugger
    commands at a ``monarch_nb debug>`` prompt: ``list``, ``attach RANK``, ``cast RANKS CMD``,
    ``continue``, ``stack [RANKS]``, ``quit``.
``%mesh debug RANK`` (or ``attach RANK``)
    pdb on that rank: its paused ``breakpoint()``, else post-mortem on its newest failure. pdb
    commands are typed at Jupyter's input prompt (``p x``, ``up``, ``l``, ``w``, ``interact``,
    ``q``...); ``detach`` leaves the session open and returns to the notebook.
``%mesh debug cast RANKS CMD`` / ``continue`` / ``list`` / ``clear [RANKS]``
    one-shot forms. RANKS: ``3``, ``0,2``, ``0-3`` or ``all``.
``%mesh stack [RANKS]``
    the live stack of every thread of each rank; ranks with the same stacks are shown together.

Every form takes ``--mesh NAME``; without it the mesh is the only one with something to debug,
else the notebook's ``%mesh start`` mesh, else the newest running one.

Input comes from Jupyter's ``input()`` (an input request on the stdin channel). For notebooks
that must run unattended (CI), pass the answers: ``debug_command("1", shell, commands=["p x", "q"])``.
:func:`frame_namespace` serves ``%%mesh --frame`` on the worker. Nothing here imports IPython.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any, Callable

from . import client
from . import requests
from .client import DebugError

__all__ = ["debug_command", "stack_command", "parse_ranks"]

DEBUG_PROMPT = "monarch_nb debug> "

_USAGE = """\
%mesh debug                      list paused and failed ranks, then a debugger prompt
%mesh debug RANK [--failure N]   pdb on RANK: its breakpoint, else its newest (or Nth) failure
%mesh debug attach RANK          the same
%mesh debug cast RANKS CMD       one pdb command on several ranks (RANKS: 3, 0,2, 0-3, all)
%mesh debug continue             resume every paused rank
%mesh debug list                 list only
%mesh debug clear [RANKS]        drop kept failures (frees the memory their frames hold)
options: --mesh NAME
in pdb: any pdb command (p x, up, down, l, w, interact, q); detach returns to the notebook"""

_LOOP_HELP = """\
commands:
  list                 paused and failed ranks
  attach RANK          pdb on RANK (detach: back here)
  cast RANKS CMD       run the pdb command CMD on several ranks (RANKS: 3, 0,2, 0-3, all)
  continue             resume every paused rank and leave
  stack [RANKS]        live stacks
  quit                 leave (paused ranks stay paused)"""


def parse_ranks(spec: str, world_size: int) -> list[int]:
    """``"3"``, ``"0,2"``, ``"0-3"``, ``"1,4-6"`` or ``"all"`` / ``"*"`` as a sorted list of ranks.

    Raises:
        ValueError: bad syntax or a rank outside ``0..world_size-1`` (the message names the range).
    """
    spec = spec.strip()
    if spec in ("all", "*", ""):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        try:
            if "-" in part[1:]:
                lo, hi = part.split("-", 1)
                ranks.update(range(int(lo), int(hi) + 1))
            else:
                ranks.add(int(part))
        except ValueError:
            raise ValueError(f"bad rank list {spec!r}: use 3, 0,2, 0-3 or all") from None
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ValueError(f"rank(s) {bad} not in the mesh: valid ranks are 0..{world_size - 1}")
    return sorted(ranks)


class _Reader:
    """Where answers come from: Jupyter's input(), or a script of commands (echoed)."""

    def __init__(self, commands: list[str] | None):
        self.script = None if commands is None else list(commands)

    def __call__(self, prompt: str) -> str:
        if self.script is not None:
            if not self.script:
                raise EOFError
            line = self.script.pop(0)
            print(f"{prompt}{line}", flush=True)
            return line
        sys.stdout.flush()
        try:
            return input(prompt)
        except Exception as exc:  # ipykernel: StdinNotImplementedError when the frontend has no stdin
            if type(exc).__name__ == "StdinNotImplementedError":
                print("(this frontend cannot answer input(); pass commands=[...] to debug_command)", flush=True)
                raise EOFError from None
            raise


def _say(text: str) -> None:
    if text:
        print(text, end="" if text.endswith("\n") else "\n", flush=True)


def _pick_mesh(explicit: str | None) -> str:
    if explicit:
        return requests.resolve_mesh(explicit)
    controller = requests.get_controller()
    live = [n for n, m in controller.meshes.items() if not m.stopped]
    if len(live) > 1:
        with_targets = sorted({t.mesh for t in client.debug_targets() if t.kind in ("paused", "failed")})
        if len(with_targets) == 1:
            return with_targets[0]
        jupyter = sys.modules.get("monarch_nb.jupyter.session")
        sess = jupyter.current(required=False) if jupyter is not None else None
        if sess is not None and sess.mesh_name in live:
            return sess.mesh_name
    return requests.resolve_mesh(None)


def _split_options(line: str) -> tuple[list[str], dict]:
    argv = shlex.split(line)
    options: dict[str, Any] = {}
    rest = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("--mesh", "--failure") and i + 1 < len(argv):
            options[arg[2:]] = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--mesh=") or arg.startswith("--failure="):
            key, value = arg[2:].split("=", 1)
            options[key] = value
        else:
            rest.append(arg)
        i += 1
    return rest, options


def debug_command(line: str, shell: Any = None, commands: list[str] | None = None) -> None:
    """``%mesh debug [RANK | attach RANK | cast RANKS CMD | continue | list | clear] [--mesh NAME]``.

    Prints into the cell; reads pdb commands with ``input()`` (or from ``commands``). Problems
    (unknown rank, dead rank, nothing to debug) are printed with what is available; nothing raises.

    Args:
        line: the text after ``%mesh debug``.
        shell: the IPython shell (unused; the signature the ``%mesh`` magic calls).
        commands: answers to use instead of ``input()``, in order; when they run out the
            debugger detaches (for notebooks run unattended).
    """
    read = _Reader(commands)
    try:
        argv, options = _split_options(line)
    except ValueError as exc:
        _say(f"debug: {exc}")
        return
    if argv and argv[0] in ("-h", "--help", "help"):
        _say(_USAGE)
        return
    try:
        mesh = _pick_mesh(options.get("mesh"))
        _dispatch(argv, mesh, options, read, loop=not argv)
    except DebugError as exc:
        _say(f"debug: {exc}")


def _dispatch(argv: list[str], mesh: str, options: dict, read: Callable[[str], str], loop: bool) -> bool:
    """Run one debugger command; return False when the debug> loop should end."""
    if not argv or argv[0] in ("list", "ls"):
        targets = client.debug_targets(mesh)
        _say(client.format_targets(targets))
        if loop and any(t.kind in ("paused", "failed") for t in targets):
            _say("type help for commands")
            _debug_loop(mesh, read)
        return True
    head = argv[0]
    if head == "attach":
        if len(argv) != 2:
            raise DebugError("usage: attach RANK")
        return _attach(argv[1], mesh, options, read)
    if head.lstrip("-").isdigit():
        return _attach(head, mesh, options, read)
    if head == "cast":
        if len(argv) < 3:
            raise DebugError("usage: cast RANKS CMD (e.g. cast 0,1 p x)")
        world = len(requests.mesh_records(mesh))
        try:
            ranks = parse_ranks(argv[1], world)
        except ValueError as exc:
            raise DebugError(f"{exc}. {client.available_text(mesh)}") from None
        outputs = client.cast(ranks, " ".join(argv[2:]), mesh)
        for rank, text in outputs.items():
            _say(f"--- rank {rank} ---")
            _say(text.rstrip("\n") or "(no output)")
        return True
    if head in ("continue", "c", "cont"):
        resumed = client.continue_all(mesh)
        if not resumed:
            _say("no rank is paused")
        for rank, text in resumed.items():
            _say(f"rank {rank}: {text.strip() or 'continued'}")
        return False
    if head == "clear":
        world = len(requests.mesh_records(mesh))
        which = parse_ranks(argv[1], world) if len(argv) > 1 else None
        cleared = client.clear_failures(mesh, which)
        _say(", ".join(f"rank {r}: {n} failure(s) dropped" for r, n in cleared.items()) or "nothing to clear")
        return True
    if head == "stack":
        _print_stacks(mesh, argv[1:])
        return True
    if head in ("quit", "q", "exit", "detach"):
        return False
    raise DebugError(f"unknown debugger command {head!r}; the commands: list, attach RANK, cast RANKS CMD, continue, "
                     "clear, stack, quit (%mesh debug --help)")


def _attach(rank_text: str, mesh: str, options: dict, read: Callable[[str], str]) -> bool:
    try:
        rank = int(rank_text)
    except ValueError:
        raise DebugError(f"{rank_text!r} is not a rank. {client.available_text(mesh)}") from None
    failure = int(options["failure"]) if options.get("failure") else None
    session = client.DebugSession(rank, mesh, failure=failure)
    _pdb_loop(session, read)
    return True


def _pdb_loop(session: client.DebugSession, read: Callable[[str], str]) -> None:
    _say(session.banner)
    while not session.ended:
        prompt = session.prompt or "(Pdb) "
        try:
            line = read(f"[rank {session.rank}] {prompt}")
        except (EOFError, KeyboardInterrupt):
            _say(f"(detached from rank {session.rank}; the session stays open: %mesh debug {session.rank} returns to it"
                 + (", %mesh debug continue resumes paused ranks)" if session.prompt else ")"))
            return
        if line.strip() == "detach":
            _say(f"(detached from rank {session.rank}; %mesh debug {session.rank} returns to it)")
            return
        try:
            _say(session.command(line))
        except DebugError as exc:
            _say(f"debug: {exc}")
            return
        except KeyboardInterrupt:  # stopped waiting for a long command (``n`` over a slow call)
            _say(f"(interrupted: detached from rank {session.rank}, which goes on with the command; "
                 f"%mesh debug {session.rank} returns to it once it stops)")
            return


def _debug_loop(mesh: str, read: Callable[[str], str]) -> None:
    while True:
        try:
            line = read(DEBUG_PROMPT)
        except (EOFError, KeyboardInterrupt):
            _say("(left the debugger; paused ranks stay paused)")
            return
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            _say(f"debug: {exc}")
            continue
        if not argv:
            continue
        if argv[0] == "help":
            _say(_LOOP_HELP)
            continue
        try:
            if not _dispatch(argv, mesh, {}, read, loop=False):
                return
        except DebugError as exc:
            _say(f"debug: {exc}")


def _print_stacks(mesh: str, argv: list[str]) -> None:
    world = len(requests.mesh_records(mesh))
    try:
        ranks = parse_ranks(",".join(argv), world) if argv else None
    except ValueError as exc:
        raise DebugError(str(exc)) from None
    _say(client.format_stacks(mesh, ranks))


def stack_command(line: str, shell: Any = None) -> None:
    """``%mesh stack [RANKS] [--mesh NAME]``: print the live stack of every thread of the ranks
    (all ranks by default, grouped where stacks are identical). Problems are printed, not raised."""
    try:
        argv, options = _split_options(line)
        if argv and argv[0] in ("-h", "--help", "help"):
            _say("usage: %mesh stack [RANKS] [--mesh NAME]   (RANKS: 3, 0,2, 0-3, all)")
            return
        _print_stacks(_pick_mesh(options.get("mesh")), argv)
    except (DebugError, ValueError) as exc:
        _say(f"stack: {exc}")
