"""Runtime settings, with defaults in one place. A few meaningful timeouts; the rest derive.

Each field can be overridden by an environment variable ``MONARCH_NB_<FIELD NAME IN CAPS>``
(read when the controller starts) or by ``monarch_nb.configure(field=value)`` before the
first mesh is spawned.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Config", "config", "configure"]


def _setting(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    heartbeat_interval_s: float = _setting(0.25, "seconds between a proc's heartbeats")
    hang_timeout_s: float = _setting(2.0, "a proc silent this long (seconds) is reported hung")
    import_grace_s: float = _setting(60.0, "how long (seconds) a proc importing torch or another heavy module may be silent")
    heartbeats_via_agents: bool = _setting(True, "procs heartbeat to their host agent, which sums them up in one message "
                                           "per interval (False: each proc heartbeats to the controller)")
    messages_via_agents: bool = _setting(True, "a cast to several procs of a host goes to its host agent as one message, "
                                         "passed on to each (False: one message straight to each proc)")
    relay_fan_in: int = _setting(32, "attached hosts per heartbeat relay, the relay included: a tree of host agents, so the "
                                 "controller hears one agent of each group (0: every agent heartbeats to the controller)")
    relay_min_hosts: int = _setting(64, "attached hosts it takes before their agents relay each other's heartbeats")
    fence_hung: bool = _setting(True, "SIGKILL a proc once it is reported hung, releasing peers in collectives")
    transport: str = _setting("ipc", "'ipc' (one host, unix sockets) or 'tcp' (127.0.0.1 unless bind_host is set)")
    bind_host: str = _setting("127.0.0.1", "address the controller binds with the tcp transport")
    start_timeout_s: float = _setting(60.0, "seconds to wait for spawned procs to say hello")
    stop_timeout_s: float = _setting(5.0, "seconds a stopping proc gets before SIGKILL")
    sign_buffers: bool = _setting(False, "include out-of-band buffers (tensor data) in the HMAC")

    @property
    def orphan_check_s(self) -> float:
        """How often (seconds) host agents check that their controller is alive."""
        return min(0.1, self.heartbeat_interval_s)

    @classmethod
    def from_env(cls) -> "Config":
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = os.environ.get(f"MONARCH_NB_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("bool", bool):
                values[f.name] = raw.lower() in ("1", "true", "yes", "on")
            elif f.type in ("float", float):
                values[f.name] = float(raw)
            elif f.type in ("int", int):
                values[f.name] = int(raw)
            else:
                values[f.name] = raw
        return cls(**values)


config = Config.from_env()


def configure(**settings) -> Config:
    """Change settings (names as in :class:`Config`); returns the config.

    Raises:
        TypeError: an unknown setting; the message lists the known ones.
    """
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = set(settings) - known
    if unknown:
        raise TypeError(f"unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    for name, value in settings.items():
        setattr(config, name, value)
    return config
