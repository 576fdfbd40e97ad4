"""Actor, @endpoint, @concurrent_endpoint, and the adverbs of a mesh endpoint.

Define an actor as in Monarch::

    class Counter(Actor):
        def __init__(self, start: int):
            self.value = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.value += by
            return self.value

On an :class:`~monarch_nb.actor.mesh.ActorMesh`, ``counters.incr`` is an :class:`Endpoint` whose
adverbs send the call to the mesh's members: ``call`` (a ValueMesh), ``call_one``, ``choose``,
``stream`` (Futures in arrival order), ``broadcast`` (no reply: an exception then fails the
actor). Arguments are checked against the method's signature at the caller, so a wrong call
raises ``TypeError`` before anything is sent. The adverbs take the user's arguments only
(their own parameters are positional-only), so any keyword reaches the endpoint.

``@endpoint(explicit_response_port=True)`` methods take a :class:`~monarch_nb.actor.ports.Port`
first and answer through it (callers pass the other arguments); ``@concurrent_endpoint`` (async
methods only) lets several calls run at once on one actor. An actor's endpoints are all sync or
all async: a class mixing them is refused at spawn.
"""

from __future__ import annotations

import functools
import inspect
import logging
import random
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, ParamSpec, TypeVar, overload

from .future import Future

if TYPE_CHECKING:
    from .mesh import ActorMesh
    from .ports import Port
    from .value_mesh import ValueMesh

__all__ = ["Actor", "endpoint", "concurrent_endpoint", "as_endpoint", "EndpointProperty", "Endpoint",
           "NotAnEndpoint", "endpoints_of", "check_actor_class", "send", "Accumulator"]

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")


class Actor:
    """Base class of actors. Subclass it and mark remote methods with :func:`endpoint`.

    Optional hooks, as in Monarch:
        ``__supervise__(self, failure: MeshFailure) -> bool``: called when an actor of a mesh this
            actor spawned fails; True means handled, otherwise this actor fails too.
        ``__cleanup__(self, exc)``: called when the actor stops (``exc`` is None, or what failed it).
    """

    @functools.cached_property
    def logger(self) -> logging.Logger:
        """A logger named after the class, at DEBUG."""
        logger = logging.getLogger(type(self).__name__)
        logger.setLevel(logging.DEBUG)
        return logger


class EndpointProperty(Generic[P, R]):
    """What ``@endpoint`` puts on the class. On an actor instance it is the plain bound method.

    Attributes:
        explicit_response_port: the method takes a reply Port first and answers through it.
        concurrent: calls run as tasks on the actor's loop, several at once.
        is_async: an ``async def`` method.
    """

    def __init__(self, fn: Callable[..., R], *, explicit_response_port: bool = False, concurrent: bool = False,
                 propagate: Any = None) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.owner: type | None = None
        self.is_async = inspect.iscoroutinefunction(fn)
        self.explicit_response_port = explicit_response_port
        self.concurrent = concurrent
        self.propagate = propagate
        # the method's name, doc and __wrapped__ on the descriptor; typeshed wants a callable wrapper
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.owner = owner  # the actor class it was defined on

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    @functools.cached_property
    def _fixed(self) -> int:
        """Leading parameters the runtime fills: self, and the port of an explicit-port endpoint."""
        return 2 if self.explicit_response_port else 1

    @functools.cached_property
    def _takes_nothing_more(self) -> bool:
        """No parameter beyond the fixed ones is required: a call with no arguments fits."""
        params = list(self.signature.parameters.values())[self._fixed:]
        return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params) and \
            len(self.signature.parameters) >= self._fixed

    def check_arguments(self, owner: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise TypeError naming the endpoint if ``(args, kwargs)`` do not fit its signature."""
        if not args and not kwargs and self._takes_nothing_more:
            return
        try:
            self.signature.bind(*((None,) * self._fixed), *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{owner}.{self.name}{self.public_signature()}: {exc}") from None

    def public_signature(self) -> str:
        params = list(self.signature.parameters.values())[self._fixed:]
        return str(self.signature.replace(parameters=params))


@overload
def endpoint(fn: Callable[..., R]) -> EndpointProperty[..., R]: ...
@overload
def endpoint(*, propagate: Any = None, explicit_response_port: bool = False,
             instrument: bool = True) -> Callable[[Callable[..., R]], EndpointProperty[..., R]]: ...


def endpoint(fn: Callable[..., Any] | None = None, *, propagate: Any = None, explicit_response_port: bool = False,
             instrument: bool = True) -> Any:
    """Mark an actor method (sync or ``async def``) as callable from other processes.

    Args:
        explicit_response_port: the method's first parameter (after self) is a Port; the caller's
            Future gets what the method sends through it (``port.send(v)``), the method's return
            value is dropped, and an exception it raises fails the actor.
        propagate, instrument: accepted for Monarch compatibility; no effect.
    """
    def wrap(f: Callable[..., Any]) -> EndpointProperty[..., Any]:
        if isinstance(f, EndpointProperty):
            return f
        return EndpointProperty(f, explicit_response_port=explicit_response_port, propagate=propagate)

    return wrap if fn is None else wrap(fn)


def concurrent_endpoint(fn: Callable[..., Any] | None = None, *, propagate: Any = None,
                        explicit_response_port: bool = False, instrument: bool = True) -> Any:
    """Like :func:`endpoint`, for ``async def`` methods whose calls may run at once on one actor:
    each call is a task on the actor's loop, and the actor handles its next message meanwhile.
    Tasks still running when the actor stops are cancelled before ``__cleanup__``.

    Raises:
        ValueError: the method is not ``async def``, or is already an ``@endpoint``.
    """
    def wrap(f: Callable[..., Any]) -> EndpointProperty[..., Any]:
        if isinstance(f, EndpointProperty):
            raise ValueError("concurrent_endpoint does not wrap @endpoint; pass endpoint options to @concurrent_endpoint")
        if not inspect.iscoroutinefunction(f):
            raise ValueError("concurrent_endpoint can only wrap async endpoints (async def)")
        return EndpointProperty(f, explicit_response_port=explicit_response_port, concurrent=True, propagate=propagate)

    return wrap if fn is None else wrap(fn)


def endpoints_of(cls: type) -> dict[str, EndpointProperty[..., Any]]:
    """The endpoints of an actor class, by name, including inherited ones."""
    found: dict[str, EndpointProperty[..., Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, EndpointProperty):
                found[name] = value
    return found


def _user_method(cls: type, name: str) -> Any:
    for klass in cls.__mro__:
        if klass is Actor or klass is object:
            return None
        if name in vars(klass):
            return vars(klass)[name]
    return None


def check_actor_class(cls: type) -> None:
    """Refuse, as Monarch does, an actor class that mixes sync and async endpoints (or a
    ``__cleanup__`` / ``__supervise__`` of the other kind).

    Raises:
        ValueError: the message lists the sync and the async members.
    """
    sync: list[str] = []
    asynchronous: list[str] = []
    for name, prop in endpoints_of(cls).items():
        (asynchronous if prop.is_async or prop.concurrent else sync).append(name)
    if sync and asynchronous:
        raise ValueError(
            f"{cls} mixes both async and sync endpoints. Synchronous endpoints cannot be mixed with asynchronous "
            f"ones in one actor: make them all `def` or all `async def` (sync: {sorted(sync)} async: {sorted(asynchronous)})"
        )
    cleanup = _user_method(cls, "__cleanup__")
    if cleanup is not None and (sync or asynchronous) and inspect.iscoroutinefunction(cleanup) != bool(asynchronous):
        kind = "async" if asynchronous else "sync"
        raise ValueError(f"{cls} has {kind} endpoints, so its __cleanup__ must be {kind} too")
    supervise = _user_method(cls, "__supervise__")
    if supervise is not None and sync and inspect.iscoroutinefunction(supervise):
        raise ValueError(f"{cls} has sync endpoints, so its __supervise__ must be sync too")


def is_async_actor(cls: type) -> bool:
    """True if the actor's endpoints (or hooks) are ``async def``: it gets an asyncio loop."""
    if any(p.is_async or p.concurrent for p in endpoints_of(cls).values()):
        return True
    return any(inspect.iscoroutinefunction(_user_method(cls, h)) for h in ("__cleanup__", "__supervise__")
               if _user_method(cls, h) is not None)


class Endpoint(Generic[P, R]):
    """An endpoint of an actor mesh; choose how to call it with an adverb."""

    def __init__(self, mesh: "ActorMesh[Any]", prop: EndpointProperty[P, R], as_endpoint: bool = False) -> None:
        self._mesh = mesh
        self._prop = prop
        self._as_endpoint = as_endpoint
        self.name = prop.name

    def _check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._prop.check_arguments(self._mesh._cls.__name__, args, kwargs)

    def _send(self, args: tuple[Any, ...], kwargs: dict[str, Any], **how: Any) -> Any:
        return self._mesh._send(self.name, args, kwargs, as_endpoint=self._as_endpoint, **how)

    def call(self, /, *args: P.args, **kwargs: P.kwargs) -> "Future[ValueMesh[R]]":
        """Call every member; the future's value is a ValueMesh with the mesh's dims.

        Raises (from ``get``): ActorError if any member raised, SupervisionError if a member (or
        its proc) failed; the first by rank, with the others' ActorErrors in ``.others``.
        """
        self._check(args, kwargs)
        future: Future[ValueMesh[R]] = self._send(args, kwargs, targets=None, single=False)
        return future

    def call_one(self, /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the only member of a mesh of size 1.

        Raises:
            ValueError: the mesh has more than one member (slice it first).
        """
        size = len(self._mesh._shape)
        if size != 1:
            raise ValueError(
                f"call_one requires exactly 1 actor, but mesh has {size} "
                f"(dims {dict(self._mesh.extent)}); slice it first, e.g. "
                f".slice({next(iter(self._mesh.extent), 'gpus')}=0), or use call()"
            )
        self._check(args, kwargs)
        future: Future[R] = self._send(args, kwargs, targets=None, single=True)
        return future

    def choose(self, /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one member, picked at random among the live ones (load balancing)."""
        self._check(args, kwargs)
        index = random.choice(self._mesh._live_indices())
        future: Future[R] = self._send(args, kwargs, targets=[index], single=True)
        return future

    def broadcast(self, /, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every member without waiting for replies. FIFO per sender, like every call.
        There is no reply to carry an error: an exception in the endpoint fails the actor (its
        owner's ``__supervise__`` or the fault hook is told)."""
        self._check(args, kwargs)
        self._send(args, kwargs, targets=None, single=False, want_reply=False)

    def stream(self, /, *args: P.args, **kwargs: P.kwargs) -> Iterator[Future[R]]:
        """Call every member; yield one Future per member: the n-th resolves to the n-th reply to
        arrive (``[await f for f in mesh.ep.stream()]``)."""
        self._check(args, kwargs)
        return iter(self._send(args, kwargs, targets=None, single=False, stream=True))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through an adverb: .{self.name}.call(...), .call_one(...), "
            ".choose(...), .broadcast(...) or .stream(...)"
        )

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self.name}{self._prop.public_signature()}>"


class NotAnEndpoint:
    """``mesh.method`` for a method not marked ``@endpoint``: wrap it with :func:`as_endpoint`."""

    def __init__(self, mesh: "ActorMesh[Any]", name: str, fn: Callable[..., Any]) -> None:
        self._mesh = mesh
        self._name = name
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"Actor {self._mesh._cls}.{self._name} is not annotated as an endpoint. To call it as one, add a "
            f"@endpoint decorator to it, or directly wrap it in one as_endpoint(obj.method).call(...)"
        )

    def __getattr__(self, attr: str) -> Any:
        if attr in ("call", "call_one", "choose", "broadcast", "stream"):
            self()
        raise AttributeError(attr)


def as_endpoint(not_an_endpoint: Any, *, propagate: Any = None, explicit_response_port: bool = False) -> Endpoint[..., Any]:
    """Call a method of a spawned actor that is not marked ``@endpoint``:
    ``as_endpoint(mesh.method).call(...)``.

    Raises:
        ValueError: not a method of a spawned actor mesh.
    """
    if not isinstance(not_an_endpoint, NotAnEndpoint):
        raise ValueError("expected an method of a spawned actor")
    prop: EndpointProperty[..., Any] = EndpointProperty(not_an_endpoint._fn, explicit_response_port=explicit_response_port,
                                                        propagate=propagate)
    prop.name = not_an_endpoint._name
    return Endpoint(not_an_endpoint._mesh, prop, as_endpoint=True)


def send(endpoint: Endpoint[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], port: "Port[Any] | None" = None,
         selection: str = "all") -> None:
    """Low-level send of ``endpoint(*args, **kwargs)``.

    Args:
        port: where each selected actor's reply goes (tagged with its rank: open it with
            ``Channel.open_ranked()`` to see them); an ActorError goes there too. None: no reply,
            and an exception fails the actor, as with ``broadcast``.
        selection: ``"all"`` members or ``"choose"`` one at random.

    Raises:
        ValueError: an unknown selection.
        TypeError: the arguments do not fit the endpoint.
    """
    if selection not in ("all", "choose"):
        raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")
    endpoint._check(tuple(args), dict(kwargs))
    targets = [random.choice(endpoint._mesh._live_indices())] if selection == "choose" else None
    endpoint._send(tuple(args), dict(kwargs), targets=targets, single=False, want_reply=port is not None, port=port)


class Accumulator(Generic[P, R, A]):
    """Fold the replies of every member of a mesh: ``Accumulator(mesh.value, 0, operator.add)``.

    ``accumulate(*args, **kwargs)`` calls the endpoint on every member (as ``stream``) and returns a
    Future of ``combine(...combine(combine(identity, r1), r2)..., rn)`` over the replies in arrival
    order (``identity`` for an empty mesh). ``combine`` runs on the runtime's thread that receives
    the last reply needed, so it should be quick.
    """

    def __init__(self, endpoint: Endpoint[P, R], identity: A, combine: Callable[[A, R], A]) -> None:
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, /, *args: P.args, **kwargs: P.kwargs) -> Future[A]:
        futures = list(self._endpoint.stream(*args, **kwargs))
        result: Future[A] = Future()
        if not futures:
            result._inner.set_result(self._identity)
            return result
        value, left = self._identity, len(futures)

        def fold(fut: Future[R]) -> None:
            nonlocal value, left
            if result.done():
                return
            try:
                value = self._combine(value, fut.get())
            except BaseException as exc:  # noqa: BLE001 - the reply's error or combine's
                if not result.done():
                    result._inner.set_exception(exc)
                return
            left -= 1
            if left == 0:
                result._inner.set_result(value)

        # the n-th stream Future resolves n-th, so chaining keeps the fold in arrival order
        for fut in futures:
            fut.add_done_callback(fold)
        return result
