"""Fault specs: ``KIND@STEP:rank=R[,param=value...]``, one grammar for the CLI, the magics and training.

Examples: ``kill@120:rank=2``, ``hang@200:rank=1``, ``exit@50:rank=0,code=3``,
``slow@10:rank=1,ms=50``, ``kill@40:rank=1,phase=collective`` (the rank SIGKILLs itself in the
middle of step 40's gradient all-reduce, while its peers are inside the collective). The short
form ``kill@50:2`` means rank 2; with ``default_rank``, ``nan@80`` means that rank. The kinds and
their parameters are those of :data:`monarch_nb.runtime.protocol.FAULT_KINDS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..runtime.protocol import FAULT_KINDS, validate_fault

__all__ = ["FaultSpec", "parse_fault", "check_faults"]

_SPEC = re.compile(r"^\s*(?P<kind>[a-z_]+)\s*@\s*(?P<step>[^:]+?)\s*(?::(?P<params>.*))?$")
_PHASES = ("step", "collective")


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject into ``rank`` just before step ``step`` (``phase="collective"``: inside it).

    Attributes:
        kind: a fault kind of :data:`~monarch_nb.runtime.protocol.FAULT_KINDS`.
        step: the global step (int >= 0).
        rank: the flat proc rank (int >= 0).
        params: the kind's parameters, defaults filled in.
        phase: "step" (injected before the step is sent) or "collective" (kill only).
    """

    kind: str
    step: int
    rank: int
    params: dict = field(default_factory=dict)
    phase: str = "step"

    def __str__(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.params.items() if FAULT_KINDS[self.kind].params.get(k) != v)
        phase = ",phase=collective" if self.phase == "collective" else ""
        return f"{self.kind}@{self.step}:rank={self.rank}{extra}{phase}"


def _number(text: str):
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse_fault(spec: "str | FaultSpec | dict", default_rank: int | None = None) -> FaultSpec:
    """Parse ``"kill@120:rank=2"`` or ``"kill@120:2"`` (or pass a FaultSpec / dict with kind,
    step, rank, params). ``default_rank``: the rank of a spec that names none (else it is an error).

    Raises:
        ValueError: a malformed spec, unknown kind or parameter, missing or negative rank or step;
            the message quotes the spec and shows the expected form.
    """
    if isinstance(spec, FaultSpec):
        return spec
    if isinstance(spec, dict):
        d = dict(spec)
        params = dict(d.pop("params", {}) or {})
        kind, step, rank = d.pop("kind", None), d.pop("step", None), d.pop("rank", None)
        phase = d.pop("phase", "step")
        params.update(d)
        text = f"{kind}@{step}:rank={rank}" + "".join(f",{k}={v}" for k, v in params.items())
        if phase != "step":
            text += f",phase={phase}"
        return parse_fault(text)
    form = "KIND@STEP:rank=R[,param=value...] or KIND@STEP:R, e.g. kill@120:rank=2, kill@120:2 or slow@10:rank=1,ms=50"
    match = _SPEC.match(str(spec))
    if not match:
        raise ValueError(f"bad fault spec {spec!r}: expected {form}")
    kind = match["kind"]
    if kind not in FAULT_KINDS:
        raise ValueError(f"bad fault spec {spec!r}: unknown fault kind {kind!r}; valid kinds: {', '.join(FAULT_KINDS)}")
    try:
        step = int(match["step"])
    except ValueError:
        raise ValueError(f"bad fault spec {spec!r}: step {match['step']!r} is not an integer") from None
    if step < 0:
        raise ValueError(f"bad fault spec {spec!r}: step must be >= 0")
    params = {}
    rank = None
    phase = "step"
    items = [p.strip() for p in (match["params"] or "").split(",") if p.strip()]
    if items and items[0].isdigit():  # the short form KIND@STEP:R
        items[0] = f"rank={items[0]}"
    for item in items:
        if "=" not in item:
            raise ValueError(f"bad fault spec {spec!r}: {item!r} is not name=value; expected {form}")
        name, value = (s.strip() for s in item.split("=", 1))
        if name == "rank":
            try:
                rank = int(value)
            except ValueError:
                raise ValueError(f"bad fault spec {spec!r}: rank {value!r} is not an integer") from None
        elif name == "phase":
            if value not in _PHASES:
                raise ValueError(f"bad fault spec {spec!r}: phase must be one of {_PHASES}")
            phase = value
        else:
            try:
                params[name] = _number(value)
            except ValueError:
                raise ValueError(f"bad fault spec {spec!r}: {name}={value!r} is not a number") from None
    if rank is None:
        rank = default_rank
    if rank is None:
        raise ValueError(f"bad fault spec {spec!r}: it needs rank=R; expected {form}")
    if rank < 0:
        raise ValueError(f"bad fault spec {spec!r}: rank must be >= 0")
    if phase == "collective" and kind != "kill":
        raise ValueError(f"bad fault spec {spec!r}: phase=collective is only for kill")
    try:
        params = validate_fault(kind, params)
    except ValueError as exc:
        raise ValueError(f"bad fault spec {spec!r}: {exc}") from None
    return FaultSpec(kind, step, rank, params, phase)


def check_faults(faults: list[FaultSpec], procs: int, steps: int | None) -> None:
    """Check that every fault targets an existing rank and a step that will run (``steps`` None:
    not known yet, not checked).

    Raises:
        ValueError: a rank >= ``procs`` or a step >= ``steps``, or a plan that would fail every rank at once.
    """
    for fault in faults:
        if fault.rank >= procs:
            raise ValueError(f"fault {fault}: rank {fault.rank} does not exist; with {procs} procs the ranks are 0..{procs - 1}")
        if steps is not None and fault.step >= steps:
            raise ValueError(f"fault {fault}: step {fault.step} is never reached; the run has steps 0..{steps - 1}")
    fatal = {"kill", "segfault", "exit", "hang", "stall", "partition", "raise"}
    by_step: dict[int, set] = {}
    for fault in faults:
        if fault.kind in fatal:
            by_step.setdefault(fault.step, set()).add(fault.rank)
    for step, ranks in by_step.items():
        if len(ranks) >= procs:
            raise ValueError(f"faults at step {step} fail every rank ({sorted(ranks)}); at least one must survive to heal the others")
