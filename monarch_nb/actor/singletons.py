"""Process-wide actor API functions: ``get_or_spawn_controller`` and ``shutdown_context``."""

from __future__ import annotations

from typing import Any, TypeVar

from . import backend
from .future import Future

__all__ = ["get_or_spawn_controller", "shutdown_context"]

A = TypeVar("A")


def get_or_spawn_controller(name: str, cls: type[A], /, *args: Any, **kwargs: Any) -> "Future[Any]":
    """A Future of the one actor mesh called ``name`` of this client: spawned on the client's own
    proc (it runs in the client process) on the first call, found again by later calls with the
    same name (their arguments are then ignored), from the client or from inside any actor.

    Raises (from ``get``): ValueError if the controller's constructor failed
    (``"Failure on <name>: ..."``); TypeError if ``name`` is a controller of another class;
    TypeError/ValueError as ``spawn`` does for a bad class.
    """
    return backend.current().get_or_spawn_controller(name, cls, args, kwargs)


def shutdown_context() -> "Future[None]":
    """Stop every mesh this client started, and its runtime; a completed Future of None.
    Idempotent. A later use of the actor API starts a new runtime."""
    runtime = backend.existing()
    if runtime is not None:
        runtime.shutdown()
    return Future.completed(None)
