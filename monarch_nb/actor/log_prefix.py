"""Log records written inside an actor say which actor wrote them: ``[actor=<root>.<mod.Cls name{'gpus': 0/2}>] ...``.

As in Monarch: a filter on every handler of the root logger (and on every handler added later)
prefixes the record's message with the running actor's instance, except empty messages (which
torch's structured trace logs use). ``monarch_nb.actor.config.prefix_python_logs_with_actor =
False`` turns it off. Installed in worker procs; records written outside an actor (the proc's own
threads) are left as they are.
"""

from __future__ import annotations

import logging
import sys

from .context import context as current_context

__all__ = ["ActorLogPrefix", "install_log_prefix"]


class ActorLogPrefix(logging.Filter):
    """Prefixes a record's message with ``[actor=<instance>]`` once (never filters anything out)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_monarch_actor_prefixed", False) or record.msg == "" or record.msg is None:
            return True
        facade = sys.modules.get("monarch_nb.actor")
        settings = getattr(facade, "config", None)
        if settings is not None and not getattr(settings, "prefix_python_logs_with_actor", True):
            return True
        instance = current_context().actor_instance
        if not instance.class_name:
            return True
        record._monarch_actor_prefixed = True
        record.msg = f"[actor={instance}] {record.msg}"
        return True


_FILTER = ActorLogPrefix()
_installed = False


def install_log_prefix() -> None:
    """Add the prefix filter to the root logger's handlers, now and whenever one is added."""
    global _installed
    if _installed:
        return
    _installed = True
    for handler in logging.getLogger().handlers:
        handler.addFilter(_FILTER)
    original = logging.Logger.addHandler

    def add_handler(self: logging.Logger, hdlr: logging.Handler) -> None:
        if _FILTER not in hdlr.filters:
            hdlr.addFilter(_FILTER)
        original(self, hdlr)

    logging.Logger.addHandler = add_handler  # type: ignore[method-assign]  # on purpose: later handlers get the filter too
