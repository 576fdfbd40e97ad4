"""Running one actor: its thread (and asyncio loop, if async), mailbox, endpoints and failures.
Runs in each proc, and in the client for the actors spawned on the client's own proc; the
:class:`~monarch_nb.runtime.actor_host.ActorHost` of the process routes messages to runners.

Execution model (Monarch's): each actor has a thread of its own. An actor whose endpoints are
``async def`` runs an asyncio loop on it forever, so tasks it starts keep running between
messages and ``__supervise__`` runs while an endpoint awaits; a sync actor runs its endpoints on
the thread directly (no loop is visible to them). Messages are handled one at a time, in order
per sender; only ``@concurrent_endpoint`` calls overlap.

What a failure is: an endpoint raising with a reply port (``call``, ``call_one``, ``choose``,
``stream``, ``send(..., port=)``) is the caller's error (ActorError) and the actor lives on. With
no reply port (``broadcast``, ``send`` without a port, an ``explicit_response_port`` endpoint),
or a ``BaseException`` other than ``KeyboardInterrupt`` (which interrupts cells), or a
constructor that raises, or ``abort()``, the actor *fails*: the call in flight and every later
one get SupervisionError, its ``__cleanup__(exc)`` runs, and the controller is told
(``actor_failed``), which tells the actor's owner. Reporting never ends an actor's thread.

A stop ends it: messages queued behind the stop, and any that reach the runner after (a call
racing the stop), are answered as a stopped actor's (SupervisionError), never left unread. A
stop whose endpoint or ``__cleanup__`` has not returned within :data:`STOP_GRACE_S` is answered
anyway (:class:`~.actor_host.ActorHost`), and so is every message after it; that code goes on in
its thread until it returns or the proc exits.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..actor.context import Context, Instance
from ..actor.context import _set as set_context
from ..actor.endpoint import endpoints_of
from ..actor.failure import MeshFailure
from ..actor.ports import Port
from ..actor.shape import Extent, Point
from ..errors import UnknownEndpointError, capture_traceback, format_remote_traceback
from ..transport.serialization import loads
from .protocol import CallHeader

if TYPE_CHECKING:
    from .actor_host import ActorHost

__all__ = ["ActorRunner", "ResponsePort", "error_info", "STOP_GRACE_S"]

log = logging.getLogger("monarch_nb.actors")

#: Seconds a stopping actor gets for its cleanup before the stop is answered anyway.
STOP_GRACE_S = 10.0


def error_info(exc: BaseException, message: str | None = None) -> dict:
    info = capture_traceback(exc)
    if message:
        info["message"] = f"{message}: {info['message']}"
    return info


#: The most points of message slices an actor keeps (a slice's ranks get the same few each call).
_MAX_POINTS = 256


class ResponsePort(Port):
    """The reply port of one call, handed to an ``explicit_response_port`` endpoint."""

    def __init__(self, host: "ActorHost", header: CallHeader | None, rank: int):
        super().__init__(host.identity, "", once=True, rank=rank)
        self._host = host
        self._header = header

    def send(self, obj: Any) -> None:
        self._use()
        if self._header is not None:
            self._host.reply(self._header, True, obj)

    def exception(self, exc: BaseException) -> None:
        self._use()
        if self._header is not None:
            self._host.reply(self._header, False, error_info(exc))

    def __reduce__(self):
        raise TypeError("a call's response port cannot be passed on; open a Channel for that")


class ActorRunner:
    """One actor: its instance, its mailbox and the thread (and loop, if async) that runs it.

    Attributes:
        name: the actor mesh's id on this proc (what calls are addressed to).
        instance: the actor object (None until constructed).
        current: ``(endpoint, monotonic start)`` of the message being handled, or None.
        failed: the failure's plain-data report once the actor failed, else None.
    """

    def __init__(self, host: "ActorHost", name: str, asynchronous: bool):
        self.host = host
        self.name = name
        self.asynchronous = asynchronous
        self.instance: Any = None
        self.endpoints: dict = {}
        self.instance_ctx: Instance | None = None
        self.current: tuple[str, float] | None = None
        self.failed: dict | None = None
        self.stopped = False
        self.abandoned = False  # stopped while its constructor ran: stop once it returns
        self.mailbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False  # nothing reads the mailbox any more (the stop ended, or overran): a message posted now is refused
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aqueue: asyncio.Queue | None = None
        self._tasks: set = set()
        self._current_task: asyncio.Task | None = None
        self._current_header: CallHeader | None = None
        self._loop_ready = threading.Event()
        self._leading = False
        self._own_context: Context | None = None
        self._points: dict[tuple, Point] = {}  # a slice's points by (dims, sizes, index): a call_one to a slice each time
        self.thread = threading.Thread(target=self._run_async if asynchronous else self._run_sync,
                                       name=f"actor-{name}", daemon=True)
        self.thread.start()
        self._thread_id = self.thread.ident  # (the property is a Python call; post reads it on every message)
        if asynchronous:
            self._loop_ready.wait()

    # -- delivery (any thread) ----------------------------------------------------------------
    def post(self, item: tuple) -> None:
        """Queue ``item`` for the actor's thread (any thread). Every item leaves the mailbox once:
        to the actor, or, once nothing reads it (a call racing the stop), refused with SupervisionError."""
        self.mailbox.put(item)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._pump)
            except RuntimeError:  # the loop is closed: the stop ended (refused below)
                pass
        elif self._leading and threading.get_ident() != self._thread_id:
            self.host.wake()  # it is receiving on its own thread: look at the mailbox
        if self._closed:  # nothing reads the mailbox now: whatever is left there is answered here
            self._refuse_left()

    def _pump(self) -> None:
        """One mailbox item to the asyncio dispatcher (loop thread)."""
        try:
            item = self.mailbox.get_nowait()
        except queue.Empty:  # taken by _refuse_left
            return
        if self.stopped or self._closed:  # it came after the stop
            self._refuse(item)
        else:
            assert self._aqueue is not None  # made with the loop, before the runner is handed out
            self._aqueue.put_nowait(item)

    def close(self) -> None:
        """Nothing will read the mailbox any more (any thread; idempotent): the actor's thread
        ended after its stop, or its ``__cleanup__`` overran the stop's grace and it is left to
        it. What came after the stop is answered now, and whatever comes later at once."""
        self._closed = True
        self._refuse_left()

    def _refuse_left(self) -> None:
        while True:
            try:
                item = self.mailbox.get_nowait()
            except queue.Empty:
                return
            self._refuse(item)

    def _refuse(self, item: tuple) -> None:
        """Answer a message that came after the stop as :meth:`_refused` answers one."""
        kind, header = item[0], item[1]
        if kind == "stop":
            if header is not None:
                self.host.reply(header, True, None)  # stopped already
        elif kind != "supervise":  # a stopped actor supervises nothing
            self.host.reply_failure(header, self.tombstone())

    def supervise(self, failure: MeshFailure) -> None:
        """Run ``__supervise__(failure)`` (async actors: at once, even while an endpoint awaits)."""
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(lambda: self._track(loop.create_task(self._supervise_async(failure))))
            except RuntimeError:
                pass
        else:
            self.post(("supervise", None, failure, None))

    # -- sync actors ----------------------------------------------------------------------------
    def _next_item(self) -> tuple:
        """The next message: while none is queued, receive on this thread (no hand-off from the
        IO thread) if it may lead; else wait for one to be dispatched here."""
        mailbox = self.mailbox
        lead = self.host.lead
        while True:
            if not mailbox.empty():  # (not get_nowait's queue.Empty: an exception a message, raised cold in a large mesh)
                return mailbox.get_nowait()
            if lead is None:
                return mailbox.get()
            self._leading = True
            try:
                led = lead(mailbox.qsize, None, False)  # done once one waits (a C call: no lambda run cold)
            finally:
                self._leading = False
            if not led:
                return mailbox.get()

    def _run_sync(self) -> None:
        while True:
            kind, header, body, buffers = self._next_item()
            if kind == "stop":
                self._stop_sync(header)
                self.close()
                return
            try:
                if kind == "supervise":
                    self._supervise_sync(body)
                else:
                    self._handle_sync(kind, header, body, buffers)
            except BaseException:  # noqa: BLE001 - nothing may end the actor's thread
                log.exception("actor %s: unexpected error while handling a message", self.name)

    def _handle_sync(self, kind: str, header: CallHeader, body: Any, buffers: list) -> None:
        if self._refused(header):
            return
        self.current = (header.get("ep", "__init__"), time.monotonic())
        self._current_header = header
        try:
            if kind == "spawn":
                self._construct(header, body, buffers)
                self.host.reply(header, True, None)
                if self.abandoned:
                    self.stop(None)
                return
            fn, args, kwargs, prop = self._prepare(header, body, buffers)
            if prop is not None and prop.explicit_response_port:
                fn(ResponsePort(self.host, header if self._wants_reply(header) else None, self._message_rank(header).rank),
                   *args, **kwargs)
                return
            result = fn(*args, **kwargs)
            self.host.reply(header, True, self._after(header, result) if self.host.call_hooks else result)
        except BaseException as exc:  # noqa: BLE001 - reported, or fails the actor
            self._on_error(kind, header, exc)
        finally:
            self.current = None
            self._current_header = None

    def _stop_sync(self, header: CallHeader | None) -> None:
        self.stopped = True
        if self.failed is None:
            self._cleanup(None)
        self.host.stopped(self, header)

    def _supervise_sync(self, failure: MeshFailure) -> None:
        fn = getattr(self.instance, "__supervise__", None)
        try:
            handled = bool(fn(failure)) if fn is not None and self.failed is None else False
        except BaseException as exc:  # noqa: BLE001
            self._fail_unhandled(failure, exc)
            return
        if not handled:
            self._fail_unhandled(failure, None)

    # -- async actors ---------------------------------------------------------------------------
    def _run_async(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._aqueue = asyncio.Queue()
        loop.create_task(self._dispatch())
        self._loop_ready.set()
        try:
            loop.run_forever()
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            except BaseException:  # noqa: BLE001
                pass
            loop.close()
            self.close()

    async def _dispatch(self) -> None:
        assert self._aqueue is not None
        while True:
            kind, header, body, buffers = await self._aqueue.get()
            if kind == "stop":
                await self._stop_async(header)
                return
            try:
                await self._handle_async(kind, header, body, buffers)
            except BaseException:  # noqa: BLE001 - nothing may end the dispatcher
                log.exception("actor %s: unexpected error while handling a message", self.name)

    async def _handle_async(self, kind: str, header: CallHeader, body: Any, buffers: list) -> None:
        if self._refused(header):
            return
        if kind == "spawn":
            self.current = ("__init__", time.monotonic())
            try:
                self._construct(header, body, buffers)
                self.host.reply(header, True, None)
                if self.abandoned:
                    self.stop(None)
            except BaseException as exc:  # noqa: BLE001
                self._on_error(kind, header, exc)
            finally:
                self.current = None
            return
        try:
            fn, args, kwargs, prop = self._prepare(header, body, buffers)
        except BaseException as exc:  # noqa: BLE001
            self._on_error(kind, header, exc)
            return
        if prop is not None and prop.concurrent:
            self._track(asyncio.get_running_loop().create_task(self._run_one(kind, header, fn, args, kwargs, prop)))
            return
        task = asyncio.get_running_loop().create_task(self._run_one(kind, header, fn, args, kwargs, prop))
        self._current_task = task
        self.current = (header.get("ep", ""), time.monotonic())
        self._current_header = header
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        finally:
            self._current_task = None
            self.current = None
            self._current_header = None

    async def _run_one(self, kind: str, header: CallHeader, fn: Callable, args: tuple, kwargs: dict, prop: Any) -> None:
        set_context(self._context(header) if "mx" in header else self._own_context)
        try:
            if prop is not None and prop.explicit_response_port:
                port = ResponsePort(self.host, header if self._wants_reply(header) else None, self._message_rank(header).rank)
                result = fn(port, *args, **kwargs)
                if inspect.isawaitable(result):
                    await result
                return
            result = fn(*args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
            self.host.reply(header, True, self._after(header, result) if self.host.call_hooks else result)
        except asyncio.CancelledError:
            if self.failed is None and not self.stopped:
                self._on_error(kind, header, asyncio.CancelledError("the endpoint's task was cancelled"))
            raise
        except BaseException as exc:  # noqa: BLE001
            self._on_error(kind, header, exc, explicit=prop is not None and prop.explicit_response_port)

    async def _supervise_async(self, failure: MeshFailure) -> None:
        fn = getattr(self.instance, "__supervise__", None)
        try:
            handled = fn(failure) if fn is not None and self.failed is None else False
            if inspect.isawaitable(handled):
                handled = await handled
        except BaseException as exc:  # noqa: BLE001
            self._fail_unhandled(failure, exc)
            return
        if not handled:
            self._fail_unhandled(failure, None)

    async def _stop_async(self, header: CallHeader | None) -> None:
        self.stopped = True  # from now on _pump refuses what comes; what it passed on already is refused here
        assert self._aqueue is not None
        while not self._aqueue.empty():
            self._refuse(self._aqueue.get_nowait())
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.failed is None:
            cleanup = getattr(self.instance, "__cleanup__", None)
            if cleanup is not None:
                set_context(self._context(None))
                try:
                    result = cleanup(None)
                    if inspect.isawaitable(result):
                        await result
                except BaseException:  # noqa: BLE001
                    log.exception("%s.__cleanup__ raised", self.name)
        self.host.stopped(self, header)
        asyncio.get_running_loop().stop()

    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- shared ---------------------------------------------------------------------------------
    def tombstone(self) -> dict:
        """What a message for this actor gets once it failed or stopped: its failure's report, or
        "was stopped" (plain data; the caller raises SupervisionError from it)."""
        return self.failed or self.host.stopped_info(self.name)

    def _refused(self, header: CallHeader) -> bool:
        """A failed or stopped actor answers every message with SupervisionError."""
        if self.failed is None and not self.stopped and not self.abandoned:
            return False
        self.host.reply_failure(header, self.tombstone())
        return True

    def _construct(self, header: CallHeader, body: Any, buffers: list) -> None:
        cls, args, kwargs, extent, ranks, meta = loads(body, buffers)
        point = extent.point(ranks.index(self.host.rank))
        display = f"{meta['creator_display']}.<{cls.__module__}.{cls.__qualname__} {meta['name']}{point!r}>"
        self.instance_ctx = Instance(
            meta["name"], self.name, point, f"{cls.__module__}.{cls.__qualname__}", meta.get("creator"),
            self.host.mesh_name, self.host.rank, self.host.extent, display, self.host.python,
        )
        self.instance_ctx._abort = self.abort
        self.instance_ctx._waits_on_itself = self.waits_on_itself
        self.endpoints = endpoints_of(cls)
        self._own_context = Context(self.instance_ctx, point)
        set_context(self._own_context)
        instance = cls.__new__(cls)
        instance.__init__(*args, **kwargs)
        self.instance = instance  # only a constructed actor is cleaned up

    def _context(self, header: CallHeader | None) -> Context:
        assert self.instance_ctx is not None
        return Context(self.instance_ctx, self._message_rank(header) if header else self.instance_ctx.rank)

    def _message_rank(self, header: CallHeader) -> Point:
        mx = header.get("mx")
        if mx is None:
            return self.instance_ctx.rank if self.instance_ctx is not None else Point({}, 0, Extent({}))
        key = (len(mx[0]), *mx[0], *mx[1], header.get("mi", 0))
        point = self._points.get(key)
        if point is None:
            if len(self._points) >= _MAX_POINTS:
                self._points.clear()
            point = self._points[key] = Extent(dict(zip(mx[0], mx[1]))).point(key[-1])
        return point

    def _prepare(self, header: CallHeader, body: Any, buffers: list) -> tuple:
        if self.instance is None:
            raise RuntimeError(f"actor {self.name!r} was not constructed (its constructor failed)")
        args, kwargs = loads(body, buffers) if body else ((), {})
        endpoint = header["ep"]
        prop = self.endpoints.get(endpoint)
        if prop is None:
            plain = getattr(type(self.instance), endpoint, None) if header.get("asep") else None
            if plain is None:
                raise UnknownEndpointError(
                    f"{type(self.instance).__name__} has no endpoint {endpoint!r}; its endpoints are {sorted(self.endpoints)}")
            fn = plain.__get__(self.instance)
        else:  # the arguments were checked against the signature by the caller
            fn = prop.fn.__get__(self.instance)
        for hook in self.host.call_hooks:
            hook.before_call(self.name, endpoint)
        if not self.asynchronous:
            set_context(self._context(header) if "mx" in header else self._own_context)
        return fn, args, kwargs, prop

    def _after(self, header: CallHeader, result: Any) -> Any:
        for hook in self.host.call_hooks:
            result = hook.after_call(result, self.name, header.get("ep", ""))
        return result

    @staticmethod
    def _wants_reply(header: CallHeader) -> bool:
        return "cid" in header or "port" in header

    def _on_error(self, kind: str, header: CallHeader, exc: BaseException, explicit: bool = False) -> None:
        """An endpoint (or the constructor) raised ``exc``: the caller's error, or the actor's failure."""
        info = error_info(exc)
        self.host.endpoint_failed(self.name, header.get("ep", "__init__"), exc, info)
        if kind == "spawn":
            self.host.reply(header, False, info)
            self.fail(f"{info['type']}: {info['message']} (raised in __init__)", "init", exc, info)
            return
        fatal = not isinstance(exc, (Exception, KeyboardInterrupt))
        prop = self.endpoints.get(header.get("ep", ""))
        explicit = explicit or (prop is not None and prop.explicit_response_port)
        if fatal or explicit or not self._wants_reply(header):
            where = f"{header.get('ep')}" + ("" if self._wants_reply(header) and not explicit else " (no reply port)")
            self.fail(f"{info['type']}: {info['message']} (raised in {where})", "exception", exc, info, header=header)
            return
        self.host.reply(header, False, info)

    def waits_on_itself(self, awaiting: bool) -> bool:
        """Would a wait for a reply now, on the calling thread (``awaiting``: ``await`` in the
        calling task), hold up this actor's own next message? It handles one at a time: a wait on
        a sync actor's thread, a blocking ``get()`` on an async actor's loop, or the ``await`` of
        an endpoint that is not concurrent, would wait for a message that cannot run until it ends."""
        if threading.get_ident() != self._thread_id:
            return False
        if not awaiting or self._loop is None:
            return True
        return asyncio.current_task() is self._current_task

    def abort(self, reason: str | None = None) -> None:
        """``context().actor_instance.abort(reason)``: fail this actor now."""
        self.fail(f"aborted: {reason or 'no reason provided'}", "abort", None, None)

    def fail(self, reason: str, cause: str, exc: BaseException | None, info: dict | None,
             root_report: str | None = None, header: CallHeader | None = None) -> None:
        """Fail this actor (any thread; idempotent): answer the call in flight and every later
        message with SupervisionError, cancel its tasks, run ``__cleanup__(exc)``, tell the controller."""
        if self.failed is not None or self.stopped:
            return
        display = str(self.instance_ctx) if self.instance_ctx is not None else f"<{self.name}>"
        failure = MeshFailure(self.instance_ctx.name if self.instance_ctx else self.name,
                              [self.instance_ctx.rank.rank if self.instance_ctx else self.host.rank],
                              display, reason, cause, root_report)
        report = failure.report()
        if info is not None and root_report is None:
            report += "\n" + format_remote_traceback(info).rstrip("\n")
            failure._report = report
        self.failed = {"supervision": True, "cause": "actor failed", "detail": reason, "report": report,
                       "rank": failure.crashed_ranks[0]}
        # the owner hears first: its __supervise__ runs before the callers see the error (as in Monarch)
        self.host.actor_failed(self, failure)
        for pending in (header, self._current_header):  # the failing call, and the one in flight
            if pending is not None and "_done" not in pending:
                self.host.reply_failure(pending, self.failed)
        if self._loop is not None:
            def cancel() -> None:
                for task in list(self._tasks) + ([self._current_task] if self._current_task else []):
                    task.cancel()
            try:
                self._loop.call_soon_threadsafe(cancel)
            except RuntimeError:
                pass
        cleanup = getattr(self.instance, "__cleanup__", None)
        if cleanup is not None and not inspect.iscoroutinefunction(cleanup):
            try:
                cleanup(exc if isinstance(exc, Exception) else Exception(reason))
            except BaseException:  # noqa: BLE001
                log.exception("%s.__cleanup__ raised", self.name)

    def _fail_unhandled(self, failure: MeshFailure, raised: BaseException | None) -> None:
        """A child's failure this actor did not handle: it fails too, carrying the root cause."""
        report = failure.report()
        if raised is not None:
            report += f"\n  while handling it, __supervise__ raised {type(raised).__name__}: {raised}"
        why = "__supervise__ raised" if raised is not None else "unhandled"
        self.fail(f"{why}: failure of its child mesh {failure.mesh_name} (ranks {failure.crashed_ranks})",
                  "supervision", raised, None, root_report=report)

    def _cleanup(self, exc: BaseException | None) -> None:
        cleanup = getattr(self.instance, "__cleanup__", None)
        if cleanup is None:
            return
        if self.instance_ctx is not None:
            set_context(self._context(None))
        try:
            cleanup(exc)
        except BaseException:  # noqa: BLE001
            log.exception("%s.__cleanup__ raised", self.name)

    def interrupt(self) -> None:
        """Interrupt the endpoint running now (IO thread): the actor's ``__interrupt__`` hook
        decides how (``%%mesh`` cells raise KeyboardInterrupt in their thread); no hook, no-op."""
        hook = getattr(self.instance, "__interrupt__", None)
        if hook is not None and self.current is not None:
            try:
                hook(self.thread.ident)
            except Exception:
                log.exception("%s.__interrupt__ raised", self.name)

    def stop(self, header: CallHeader | None = None) -> None:
        """Queue the stop: after the messages already queued, cancel tasks, run ``__cleanup__``."""
        self.post(("stop", header, None, None))
