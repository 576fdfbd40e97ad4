"""Actor, @endpoint, and the adverbs (call, call_one, choose, broadcast, stream) of a mesh endpoint.

Define an actor as in Monarch::

    class Counter(Actor):
        def __init__(self, start: int):
            self.value = start

        @endpoint
        def incr(self, by: int = 1) -> int:
            self.value += by
            return self.value

On an :class:`~monarch_nb.actor.mesh.ActorMesh`, ``counters.incr`` is an :class:`Endpoint` whose
adverbs send the call to the mesh's members. Arguments are checked against the method's
signature at the caller, so a wrong call raises ``TypeError`` before anything is sent.
"""

from __future__ import annotations

import functools
import inspect
import random
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, ParamSpec, TypeVar, overload

from .future import Future

if TYPE_CHECKING:
    from .mesh import ActorMesh
    from .value_mesh import ValueMesh

__all__ = ["Actor", "endpoint", "EndpointProperty", "Endpoint", "endpoints_of"]

P = ParamSpec("P")
R = TypeVar("R")


class Actor:
    """Base class of actors. Subclass it and mark remote methods with :func:`endpoint`.

    Optional hooks, as in Monarch:
        ``__supervise__(self, failure) -> bool``: on the owner of a child mesh; return True if the
            failure of a child was handled.
        ``__cleanup__(self, exc)``: called on the proc when the actor is stopped.
    """


class EndpointProperty(Generic[P, R]):
    """What ``@endpoint`` puts on the class. On an actor instance it is the plain bound method."""

    def __init__(self, fn: Callable[..., R]):
        self.fn = fn
        self.name = fn.__name__
        self.is_async = inspect.iscoroutinefunction(fn)
        functools.update_wrapper(self, fn)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self.fn.__get__(obj, objtype)

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    def check_arguments(self, owner: str, args: tuple, kwargs: dict) -> None:
        """Raise TypeError naming the endpoint if ``(args, kwargs)`` do not fit its signature."""
        try:
            self.signature.bind(None, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{owner}.{self.name}{_public_signature(self.signature)}: {exc}") from None


def _public_signature(sig: inspect.Signature) -> str:
    params = list(sig.parameters.values())[1:]  # drop self
    return str(sig.replace(parameters=params))


@overload
def endpoint(fn: Callable[..., R]) -> EndpointProperty[..., R]: ...
@overload
def endpoint(*, propagate: Any = None) -> Callable[[Callable[..., R]], EndpointProperty[..., R]]: ...


def endpoint(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Mark an actor method (sync or ``async def``) as callable from other processes."""
    if fn is None:
        return lambda f: EndpointProperty(f)
    return EndpointProperty(fn)


def endpoints_of(cls: type) -> dict[str, EndpointProperty]:
    """The endpoints of an actor class, by name, including inherited ones."""
    found: dict[str, EndpointProperty] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, EndpointProperty):
                found[name] = value
    return found


class Endpoint(Generic[P, R]):
    """An endpoint of an actor mesh; choose how to call it with an adverb."""

    def __init__(self, mesh: "ActorMesh", prop: EndpointProperty):
        self._mesh = mesh
        self._prop = prop
        self.name = prop.name

    def _check(self, args: tuple, kwargs: dict) -> None:
        self._prop.check_arguments(self._mesh._cls.__name__, args, kwargs)

    def call(self, *args: P.args, **kwargs: P.kwargs) -> "Future[ValueMesh[R]]":
        """Call every member; the future's value is a ValueMesh with the mesh's dims.

        Raises (from ``get``): ActorError if any member raised, SupervisionError if a member's proc
        failed; the first by rank, with the others in ``.others``.
        """
        self._check(args, kwargs)
        return self._mesh._send(self.name, args, kwargs, targets=None, single=False)

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call the only member of a mesh of size 1.

        Raises:
            ValueError: the mesh has more than one member (slice it first).
        """
        size = len(self._mesh._shape)
        if size != 1:
            raise ValueError(
                f"call_one needs a mesh of exactly 1 actor, this one has {size} "
                f"(dims {dict(self._mesh.extent)}); slice it first, e.g. .slice(**{{...: 0}}), or use call()"
            )
        self._check(args, kwargs)
        return self._mesh._send(self.name, args, kwargs, targets=None, single=True)

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
        """Call one member, picked at random among the live ones (load balancing)."""
        self._check(args, kwargs)
        index = random.choice(self._mesh._live_indices())
        return self._mesh._send(self.name, args, kwargs, targets=[index], single=True)

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every member without waiting for replies. FIFO per sender, like every call."""
        self._check(args, kwargs)
        self._mesh._send(self.name, args, kwargs, targets=None, single=False, want_reply=False)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> Iterator[R]:
        """Call every member; yield each value as it arrives (completion order).

        Raises (while iterating): the member's ActorError or SupervisionError.
        """
        self._check(args, kwargs)
        futures = [
            self._mesh._send(self.name, args, kwargs, targets=[i], single=True) for i in range(len(self._mesh._shape))
        ]
        return _as_completed(futures)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"call an endpoint through an adverb: .{self.name}.call(...), .call_one(...), "
            ".choose(...), .broadcast(...) or .stream(...)"
        )

    def __repr__(self) -> str:
        return f"<Endpoint {self._mesh._name}.{self.name}{_public_signature(self._prop.signature)}>"


def _as_completed(futures: list[Future]) -> Iterator[Any]:
    import concurrent.futures

    by_inner = {f._inner: f for f in futures}
    for inner in concurrent.futures.as_completed(by_inner):
        yield by_inner[inner].get()
