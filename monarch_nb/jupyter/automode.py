"""The extension's input transformer: auto mode, and ``%mesh wait`` / ``barrier`` as awaits.

One function in IPython's ``input_transformers_cleanup`` (IPython's documented hook for
rewriting a cell before it runs), idempotent:

- **Auto mode** (``%mesh auto on``, ``%automesh``; like ipyparallel's ``%autopx`` and
  nbdistributed's ``%dist_mode``): a cell runs on the ranks as if it began with ``%%mesh`` (with
  the auto mode's ``--ranks``), unless its first line is a magic (``%...``, ``%%...``) or a
  shell command (``!...``): line magics, ``%mesh auto off`` included, still run in the kernel. A
  failing cell changes nothing, so the mode stays until it is turned off. The mode shows in a
  banner when it changes, in ``%mesh status``, and in a terminal IPython's prompt.
- A ``%mesh wait ...`` or ``%mesh barrier ...`` line at the top level of a kernel cell becomes
  ``await line_async(...)`` (see :mod:`.waiting`), so the kernel handles widget clicks while it
  waits. Indented lines are left alone (they may be inside a ``def``) and block.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["AutoMode", "transform"]

_WAIT_LINE = re.compile(r"^%mesh\s+(wait|barrier)(\s.*)?$")


class AutoMode:
    """Whether cells go to the ranks, and which ranks (a ``--ranks`` spec or None for all)."""

    def __init__(self) -> None:
        self.on = False
        self.ranks: str | None = None

    def banner(self) -> str:
        if not self.on:
            return "auto mode off: cells run in the kernel again (%%mesh still runs one on the ranks)"
        where = f"rank(s) {self.ranks}" if self.ranks else "every rank"
        return (f"auto mode on: every cell runs on {where} as if it began with %%mesh; cells that start with a "
                "magic (%...) or ! run in the kernel. `%mesh auto off` or `%automesh` ends it")


MODE = AutoMode()


def _first_code_line(lines: list[str]) -> str:
    for line in lines:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            return stripped
    return ""


def transform(lines: list[str]) -> list[str]:
    """The cell's lines, rewritten for auto mode and awaitable waits (see the module doc)."""
    first = _first_code_line(lines)
    if not first:
        return lines
    if MODE.on and not first.startswith(("%", "!")):
        head = "%%mesh" + (f" --ranks {MODE.ranks}" if MODE.ranks else "") + "\n"
        return [head] + lines
    if first.startswith("%%"):
        return lines
    if not any(_WAIT_LINE.match(line.rstrip("\n")) for line in lines):
        return lines
    out = []
    for line in lines:
        text = line.rstrip("\n")
        if _WAIT_LINE.match(text):
            rest = text[len("%mesh"):].strip()
            out.append(f"await __import__('monarch_nb.jupyter.waiting', fromlist=['_']).line_async(get_ipython(), {rest!r})\n")
        else:
            out.append(line)
    return out


def _prompt_in(shell: Any) -> None:
    """In a terminal IPython, mark the prompt while auto mode is on (``[mesh] In [3]:``)."""
    prompts = getattr(shell, "prompts", None)
    if prompts is None or not hasattr(prompts, "in_prompt_tokens"):
        return
    marked = "in_prompt_tokens" in vars(prompts)  # our instance attribute shadows the class's method
    if MODE.on and not marked:
        original = prompts.in_prompt_tokens

        def in_prompt_tokens(*args: Any, **kwargs: Any) -> Any:
            from pygments.token import Token

            return [(Token.Prompt, "[mesh] ")] + list(original(*args, **kwargs))

        prompts.in_prompt_tokens = in_prompt_tokens
    elif not MODE.on and marked:
        del prompts.in_prompt_tokens


def set_mode(shell: Any, on: bool, ranks: str | None = None) -> str:
    """Turn auto mode on or off; return the banner to show."""
    MODE.on = on
    MODE.ranks = ranks if on else None
    _prompt_in(shell)
    return MODE.banner()


def install(shell: Any) -> None:
    """Add :func:`transform` to ``shell``'s cleanup transformers (once)."""
    transforms = shell.input_transformers_cleanup
    if transform not in transforms:
        transforms.append(transform)


def uninstall(shell: Any) -> None:
    transforms = shell.input_transformers_cleanup
    while transform in transforms:
        transforms.remove(transform)
    MODE.on = False
