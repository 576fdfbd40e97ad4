"""Monarch's actor API (``monarch_nb.actor``), kind by kind, over real worker processes.

Each test asserts what a Monarch user would check: ports and channels, ``send``, ``Accumulator``,
singleton controllers, non-blocking ``spawn`` whose failures reach the owner (``MeshFailure``,
``unhandled_fault_hook``, ``__supervise__``), ``ProcMesh.stop()`` as a Future that runs cleanups
and finalizers, ``this_proc()`` on the client, ``stream()`` of Futures, per-actor event loops,
``@concurrent_endpoint``, error texts; and the failing inputs of the robustness issue (errors that
cannot be printed or pickled, timed-out ``get``, keyword names shadowing the library's, a failed
spawn done again).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import operator
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import monarch_nb.actor as ma
from monarch_nb.actor import (
    Accumulator, ActorError, Channel, MeshFailure, SupervisionError, ValueMesh, get_or_spawn_controller, send,
    this_host, this_proc,
)

from .conftest import hang_deadline_s, pid_alive, wait_until
from .monarch_actors import (
    AsyncHeldCleanup, AsyncSelfCaller, AsyncWorker, BadOnRank, ControllerUser, Counter, Finalized, Fixed, HeldCleanup,
    Logs, Odd, Owner, Ported, Raiser, SelfCaller, Sender,
)

pytestmark = pytest.mark.timeout(180)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 30.0  # seconds any single reply may take on a loaded 2-core machine


@pytest.fixture
def faults():
    """Failures that reach the client's hook during the test (the hook is restored after)."""
    seen: list[MeshFailure] = []
    saved = ma.unhandled_fault_hook
    ma.unhandled_fault_hook = seen.append
    yield seen
    ma.unhandled_fault_hook = saved


def test_a_monarch_name_not_provided_says_what_to_use_instead():
    from monarch_nb.actor import attach_to_workers  # imports the module that defines it

    assert callable(attach_to_workers)
    with pytest.raises(ImportError, match="does not provide Monarch's 'attach': hosts are started by worker loops"):
        from monarch_nb.actor import attach  # noqa: F401
    with pytest.raises(ImportError, match="'ProcId': Rust runtime identities have no counterpart"):
        from monarch_nb.actor import ProcId  # noqa: F401
    with pytest.raises(AttributeError):
        ma.no_such_name  # noqa: B018 (any other name is an AttributeError, as for any module)


def test_every_monarch_name_imports_from_the_facade():
    import monarch_nb

    for name in ma.__all__:
        assert getattr(ma, name) is not None, name
    exec("from monarch_nb.actor import " + ", ".join(ma.__all__), {})
    for name in ("Actor", "endpoint", "this_host", "ActorError", "SupervisionError", "Future", "ValueMesh"):
        assert getattr(ma, name) is getattr(monarch_nb, name)  # one object, two import paths


def test_port_values_arrive_in_order_from_many_senders(procs4):
    senders = procs4.spawn("senders", Sender)
    port, receiver = Channel.open()
    senders.send_range.broadcast(port, 50)
    got = [receiver.recv().get(timeout=T) for _ in range(200)]
    for sender in range(4):  # four actors, each one's values in its order
        assert [i for tag, i in got if tag == sender] == list(range(50))
    # one actor, several threads: each thread's values in order
    port2, receiver2 = Channel.open()
    senders.slice(gpus=1).send_from_threads.call_one(port2, 3, 100).get(timeout=T)
    values = [receiver2.recv().get(timeout=T) for _ in range(300)]
    for t in range(3):
        assert [i for tt, i in values if tt == t] == list(range(100))


def test_once_port_ranked_port_and_send_with_selection(procs4):
    counters = procs4.spawn("counters", Counter, 5)
    once, once_receiver = Channel.open(once=True)
    senders = procs4.spawn("senders", Sender)
    assert senders.slice(gpus=0).send_twice.call_one(once).get(timeout=T) == "OncePort is already used"
    assert once_receiver.recv().get(timeout=T) == 1
    port, ranked = Channel.open_ranked()
    send(counters.incr, (1,), {}, port=port)  # every actor's reply, tagged with its rank
    assert sorted(ranked.recv().get(timeout=T) for _ in range(4)) == [(0, 6), (1, 6), (2, 6), (3, 6)]
    send(counters.incr, (10,), {}, port=port, selection="choose")
    rank, value = ranked.recv().get(timeout=T)
    assert 0 <= rank < 4 and value == 16
    send(counters.incr, (), {})  # no port: fire and forget
    assert sorted(counters.get.call().get(timeout=T).values()) == [7, 7, 7, 17]
    plain, receiver = Channel.open_ranked()
    plain.send("no rank")
    with pytest.raises(ValueError, match="without a rank"):
        receiver.recv().get(timeout=T)
    with pytest.raises(ValueError, match="selection"):
        send(counters.incr, (), {}, selection="some")


def test_port_whose_sender_died_raises_instead_of_waiting(procs4, faults, tmp_path):
    senders = procs4.spawn("senders", Sender)
    port, receiver = Channel.open()
    release = tmp_path / "release"
    senders.slice(gpus=2).hold_then_die.broadcast(port, str(release))
    assert receiver.recv().get(timeout=T) == "before"  # what it sent before dying still arrives
    release.touch()  # now the sender dies
    with pytest.raises(SupervisionError, match="rank 2"):
        receiver.recv().get(timeout=hang_deadline_s() + T)


def test_explicit_response_port_and_accumulate_and_stream_futures(procs4):
    ported = procs4.spawn("ported", Ported)
    assert ported.slice(gpus=0).add.call_one(2).get(timeout=T) == 5
    counters = procs4.spawn("counters", Counter, 1)
    assert Accumulator(counters.incr, 0, operator.add).accumulate(by=1).get(timeout=T) == 8
    assert asyncio.run(_await(Accumulator(counters.get, 100, operator.add).accumulate())) == 108
    futures = list(counters.incr.stream(by=1))
    assert len(futures) == 4 and all(isinstance(f, ma.Future) for f in futures)
    assert sorted(f.get(timeout=T) for f in futures) == [3, 3, 3, 3]
    vm = counters.get.call().get(timeout=T)
    assert isinstance(vm, ValueMesh) and vm.flatten("r").slice(r=2).item() == 3 and vm.slice(gpus=1).item() == 3


async def _await(fut):
    return await fut


def test_singleton_controller_is_found_from_the_client_and_from_actors(procs4):
    first = get_or_spawn_controller("test_singleton", Counter, 41).get(timeout=T)
    again = get_or_spawn_controller("test_singleton", Counter, 0).get(timeout=T)  # arguments ignored now
    assert first.pid.call_one().get(timeout=T) == os.getpid()  # it lives in the client process
    mine = first.instance_id.call_one().get(timeout=T)
    assert again.instance_id.call_one().get(timeout=T) == mine
    users = procs4.spawn("users", ControllerUser)
    assert set(users.singleton_id.call("test_singleton").get(timeout=T).values()) == {mine}
    assert first.incr.call_one().get(timeout=T) == 42
    local = this_proc().spawn("local_counter", Counter, 3)
    assert local.pid.call_one().get(timeout=T) == os.getpid()
    with pytest.raises(TypeError, match="the controller 'test_singleton' is a tests.monarch_actors.Counter, not a "
                                        "tests.monarch_actors.Odd: .* give this one another name"):
        get_or_spawn_controller("test_singleton", Odd).get(timeout=T)
    assert first.incr.call_one().get(timeout=T) == 43  # the controller is as it was


def test_spawn_returns_at_once_and_a_failing_constructor_reaches_the_hook(procs4, faults, tmp_path):
    t0 = time.monotonic()
    bad = procs4.spawn("model", BadOnRank, [1], str(tmp_path))
    assert time.monotonic() - t0 < 5
    with pytest.raises(ActorError, match="no good on rank 1"):
        bad.initialized.get(timeout=T)
    wait_until(lambda: faults, T, message="the failure at the hook")
    failure = faults[0]
    assert failure.mesh_name == "model" and failure.crashed_ranks == [1]
    assert "no good on rank 1" in str(failure) and "MeshFailure(mesh_name=model" in str(failure)
    assert "The actor <root>.<tests.monarch_actors.BadOnRank model{'gpus': 1/4}> and all its descendants have failed" in failure.report()
    # a failed spawn removes what it built on every rank: the others were cleaned up
    wait_until(lambda: sorted(os.listdir(tmp_path)) == ["cleanup-0", "cleanup-2", "cleanup-3"], T,
               message="cleanup on the ranks whose constructor succeeded")
    with pytest.raises(SupervisionError):
        bad.ok.call().get(timeout=T)
    fixed = procs4.spawn("model", Fixed, [1], str(tmp_path))  # the notebook re-run loop: same name again
    assert fixed.ok.call().get(timeout=T).values() == ["fixed"] * 4


@pytest.mark.parametrize("cls", [HeldCleanup, AsyncHeldCleanup], ids=["sync", "async"])
def test_a_call_that_reaches_an_actor_while_it_stops_is_refused_not_lost(procs4, cls, tmp_path):
    """A call that comes while the actor runs its ``__cleanup__`` (the stop under way) gets
    SupervisionError ("was stopped") once the stop ends; it used to wait in a mailbox no thread
    read any more (a failed spawn's cleanup raced the next call the same way)."""
    held = procs4.spawn("held", cls, str(tmp_path))
    assert held.ok.call().get(timeout=T).values() == ["ok"] * 4
    stopping = concurrent.futures.ThreadPoolExecutor(1)
    stopped = stopping.submit(lambda: held.stop().get(timeout=T))
    try:
        wait_until(lambda: len([n for n in os.listdir(tmp_path) if n.startswith("cleaning-")]) == 4, T,
                   message="every rank in its cleanup")
        during = held.ok.call()
        (tmp_path / "release").write_text("go")
        with pytest.raises(SupervisionError, match="was stopped"):
            during.get(timeout=T)
        stopped.result(timeout=T)
        with pytest.raises(SupervisionError, match="was stopped"):
            held.ok.call().get(timeout=T)
    finally:
        (tmp_path / "release").write_text("go")
        stopping.shutdown(wait=True)


def test_a_stop_whose_cleanup_does_not_return_ends_after_its_grace_and_later_calls_are_refused(procs4, tmp_path):
    """``__cleanup__`` holds (until the test lets it go): ``stop()`` returns after the grace
    (STOP_GRACE_S), not the controller's 30 s, and a call after it gets SupervisionError at once
    instead of waiting behind the cleanup for good."""
    from monarch_nb.runtime.actors import STOP_GRACE_S

    held = procs4.spawn("held", HeldCleanup, str(tmp_path))
    assert held.ok.call().get(timeout=T).values() == ["ok"] * 4
    try:
        t0 = time.monotonic()
        assert held.stop().get(timeout=T) is None
        took = time.monotonic() - t0
        assert STOP_GRACE_S - 0.5 < took < STOP_GRACE_S + 10, took
        assert len([n for n in os.listdir(tmp_path) if n.startswith("cleaning-")]) == 4  # all four still in it
        t0 = time.monotonic()
        with pytest.raises(SupervisionError, match="was stopped"):
            held.ok.call().get(timeout=T)
        assert time.monotonic() - t0 < 5
    finally:
        (tmp_path / "release").write_text("go")


@pytest.mark.parametrize("cls", [SelfCaller, AsyncSelfCaller], ids=["sync", "async"])
def test_an_actor_that_waits_for_its_own_endpoint_is_told_at_once_not_left_hanging(procs4, cls):
    """Its one message at a time would make the wait endless (Monarch's actors hang there): the
    wait raises at once, and the actor goes on serving; a call to another rank of its own mesh,
    and (async) an await from a concurrent endpoint, wait as ever."""
    actors = procs4.spawn("selfish", cls)
    me, other = actors.slice(gpus=0), actors.slice(gpus=1)
    t0 = time.monotonic()
    with pytest.raises(ActorError, match="this actor is waiting for a reply from itself, which never comes"):
        me.wait_for.call_one(me).get(timeout=T)
    with pytest.raises(ActorError, match="waiting for a reply from itself"):
        me.wait_for.call_one(actors).get(timeout=T)  # the whole mesh, itself among it
    assert time.monotonic() - t0 < 10
    assert me.ok.call_one().get(timeout=T) == "ok"  # it goes on
    assert me.wait_for.call_one(other).get(timeout=T) == ["ok"]
    if cls is AsyncSelfCaller:
        assert me.wait_concurrently.call_one(actors).get(timeout=T) == ["ok"] * 4


def test_spawn_and_adverbs_forward_any_keyword(procs4):
    odd = procs4.spawn("o", Odd, name="y", cls="c", rank=7)
    assert odd.slice(gpus=0).args_seen.call_one().get(timeout=T) == ("y", "c", 7)
    ctl = get_or_spawn_controller("odd_ctl", Odd, name="z").get(timeout=T)
    assert ctl.args_seen.call_one().get(timeout=T) == ("z", "", 0)


def test_mixing_sync_and_async_endpoints_is_refused_at_spawn(procs4):
    class Mixed(ma.Actor):
        @ma.endpoint
        def a(self):
            pass

        @ma.endpoint
        async def b(self):
            pass

    with pytest.raises(ValueError, match="mixes both async and sync"):
        procs4.spawn("mixed", Mixed)
    with pytest.raises(ValueError, match="can only wrap async"):
        ma.concurrent_endpoint(lambda self: None)


def test_no_reply_port_failures_go_to_the_hook_and_the_actor_is_failed(procs4, faults):
    raisers = procs4.spawn("raisers", Raiser)
    with pytest.raises(ActorError, match="with a reply"):
        raisers.slice(gpus=0).boom.call_one("with a reply").get(timeout=T)
    assert raisers.slice(gpus=0).ping.call_one().get(timeout=T) == "pong"  # a reply port: the actor lives
    assert not faults
    raisers.slice(gpus=1).boom.broadcast("no reply port")
    wait_until(lambda: faults, T, message="the broadcast's failure at the hook")
    assert faults[0].crashed_ranks == [1] and "no reply port" in str(faults[0])
    with pytest.raises(SupervisionError, match="and all its descendants have failed"):
        raisers.slice(gpus=1).ping.call_one().get(timeout=T)
    with pytest.raises(SupervisionError, match="SystemExit"):
        raisers.slice(gpus=2).fatal.call_one().get(timeout=T)
    assert raisers.slice(gpus=3).ping.call_one().get(timeout=T) == "pong"  # other actors keep serving


def test_owner_supervises_children_and_stopping_it_stops_what_it_owns(procs4, faults):
    second = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        owner = procs4.slice(gpus=0).spawn("owner", Owner, second)
        owner.break_child.call_one().get(timeout=T)
        seen = owner.failures_seen.call_one().get(timeout=T)
        assert seen and all("MeshFailure(mesh_name=child" in s for s in seen)
        assert not faults  # handled by the owner's __supervise__, not the client's hook
        pids = owner.child_pids.call_one().get(timeout=T)
        assert all(pid_alive(p) for p in pids)
        owner.stop().get(timeout=T)  # stops the procs it spawned, and its child mesh on `second`
        wait_until(lambda: not any(pid_alive(p) for p in pids), T, message="the owner's own procs to exit")
        with pytest.raises(SupervisionError, match="stopped"):
            owner.failures_seen.call_one().get(timeout=T)
    finally:
        second.stop()


def test_unhandled_child_failure_fails_the_owner_and_reaches_the_client(procs4, faults):
    second = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        owner = procs4.slice(gpus=0).spawn("owner", Owner, second, False)
        with pytest.raises(SupervisionError, match="child broke"):
            owner.break_child.call_one().get(timeout=T)
        wait_until(lambda: faults, T, message="the owner's failure at the hook")
        assert "Raiser child" in faults[0].report() and "child broke" in faults[0].report()
    finally:
        second.stop()


def test_async_actor_loop_runs_between_messages_and_concurrent_endpoints(procs4):
    workers = procs4.slice(gpus=0).spawn("async", AsyncWorker)
    workers.start_ticking.call_one().get(timeout=T)
    first = workers.ticks_now.call_one().get(timeout=T)
    wait_until(lambda: workers.ticks_now.call_one().get(timeout=T) > first + 5, T, message="a background task to run")
    waiting = workers.wait_gate.call_one()  # a concurrent endpoint: the actor handles the next call
    assert workers.open_gate.call_one().get(timeout=T) == "opening"
    assert waiting.get(timeout=T) == "opened"


def test_proc_mesh_stop_is_a_future_and_runs_cleanup_and_finalizers(tmp_path, no_leaked_processes):
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    marker = tmp_path / "finalized"
    actors = procs.spawn("fin", Finalized, str(marker))
    pid = actors.pid.call_one().get(timeout=T)
    no_leaked_processes.add(pid)
    stopping = procs.stop()
    assert isinstance(stopping, ma.Future) and stopping.get(timeout=T) is None
    assert asyncio.run(_await(procs.stop())) is None  # idempotent, awaitable
    wait_until(lambda: not pid_alive(pid), T, message="the proc to exit")
    assert marker.read_text() == "finalized"  # module finalizers ran: a normal interpreter exit
    with pytest.raises(ValueError, match="not owned"):
        this_host().spawn_procs(per_host={"gpus": 2}).slice(gpus=0).stop()


def test_error_texts_keep_both_chains_and_group_identical_ranks(procs4):
    raisers = procs4.spawn("raisers", Raiser)
    with pytest.raises(ActorError) as info:
        raisers.chained.call().get(timeout=T)
    text = str(info.value)
    assert text.startswith("Actor call raisers.chained failed on rank 0")
    assert "During handling of the above exception, another exception occurred" in text
    assert "KeyError: 'inner'" in text and "RuntimeError: outer" in text
    assert "ranks 0-3:" in text and text.count("RuntimeError: outer") == 2  # headline + one grouped traceback
    assert "runtime/actors.py" not in text and "runtime/proc.py" not in text  # no runtime frames above the user's
    rendered = "\n".join(info.value._render_traceback_())
    assert "--- ranks 0-3: ---" in rendered


@pytest.mark.parametrize("kind", ["str", "repr", "unpicklable", "cause"])
def test_an_error_that_cannot_be_printed_or_pickled_still_reaches_the_caller(procs4, kind):
    raiser = procs4.spawn("raiser", Raiser).slice(gpus=0)
    with pytest.raises(ActorError) as info:
        raiser.unprintable.call_one(kind).get(timeout=T)
    text = str(info.value)
    if kind == "str":
        assert "<str() failed>" in text
    if kind == "cause":
        assert "has a bad cause" in text and "<str() failed>" in text
    assert raiser.ping.call_one().get(timeout=T) == "pong"  # the actor keeps serving
    assert procs4.tree()["children"][0]["children"][0]["state"] in ("healthy", "busy")


def test_a_timed_out_get_leaves_the_call_pending_and_cancel_drops_it(procs4):
    raiser = procs4.spawn("raiser", Raiser).slice(gpus=0)
    fut = raiser.slow.call_one(1.0)
    for _ in range(2):
        with pytest.raises(TimeoutError, match="still pending"):
            fut.get(timeout=0.05)
    assert not fut.done()
    assert fut.get(timeout=T) == 1.0 and fut.done() and fut.exception() is None
    assert asyncio.run(_await(fut)) == 1.0
    polled = raiser.slow.call_one(0.3)
    deadline = time.monotonic() + T
    while True:  # a polling loop works
        try:
            assert polled.get(timeout=0.05) == 0.3
            break
        except TimeoutError:
            assert time.monotonic() < deadline, f"the polled call did not end within {T} s"
    dropped = raiser.slow.call_one(0.5)
    assert dropped.cancel() and dropped.cancelled()
    with pytest.raises(concurrent.futures.CancelledError):
        dropped.get(timeout=T)
    assert raiser.ping.call_one().get(timeout=T) == "pong"


def test_logs_written_in_an_actor_name_the_actor(procs4, tmp_path):
    logs = procs4.spawn("logs", Logs).slice(gpus=2)
    path = tmp_path / "log.txt"
    logs.log_to.call_one(str(path)).get(timeout=T)
    lines = path.read_text().splitlines()
    assert lines[0] == "[actor=<root>.<tests.monarch_actors.Logs logs{'gpus': 2/4}>] hello from an actor"
    assert lines[1] == ""  # empty messages (torch's structured logs) stay empty


def test_this_proc_actors_spawned_from_an_actor_live_in_its_proc(procs4):
    users = procs4.spawn("users", ControllerUser)
    pids = procs4.spawn("pids", Counter).pid.call().get(timeout=T).values()
    assert users.spawn_here.call().get(timeout=T).values() == pids


def _default_sigint() -> None:
    """In the child before exec: SIGINT as a terminal gives it (a suite started in the background
    of a non-interactive shell inherits it ignored, and Python keeps an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _script(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` as a user's script, as from a terminal."""
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=ROOT), preexec_fn=_default_sigint)


_SCRIPT_HEAD = """
    import time
    import monarch_nb.actor as ma
    from monarch_nb.actor import Actor, endpoint, this_host

    class Bad(Actor):
        def __init__(self):
            raise RuntimeError("constructor failed")

        @endpoint
        def x(self):
            pass
"""


def test_fault_hook_in_a_script_default_prints_and_goes_on(tmp_path):
    result = _script(tmp_path, _SCRIPT_HEAD + """
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    default_hook, seen = ma.unhandled_fault_hook, []
    ma.unhandled_fault_hook = lambda failure: (default_hook(failure), seen.append(failure))
    procs.spawn("bad", Bad)
    deadline = time.monotonic() + 60
    while not seen and time.monotonic() < deadline:  # the default hook has printed, and the script goes on
        time.sleep(0.05)
    print("still running")
    procs.stop().get()
    """)
    assert result.returncode == 0, result.stderr
    assert "still running" in result.stdout
    assert "unhandled failure of bad" in result.stderr and "constructor failed" in result.stderr


#: a script's end: a fault hook that raises, a constructor that fails, a main thread that waits 30 s
_FATAL_HOOK = """
    def fatal(failure):
        raise SystemExit(1)

    ma.unhandled_fault_hook = fatal
    procs = this_host().spawn_procs(per_host={"gpus": 1})
    procs.spawn("bad", Bad)
    for _ in range(60):
        time.sleep(0.5)
    print("not reached")
    """


def test_fault_hook_that_raises_ends_a_script_through_the_main_thread(tmp_path):
    result = _script(tmp_path, _SCRIPT_HEAD + """
    import atexit
    atexit.register(lambda: print("atexit ran", flush=True))
    """ + _FATAL_HOOK)
    assert result.returncode != 0  # KeyboardInterrupt in the main thread: SIGINT's exit status
    assert "not reached" not in result.stdout and "atexit ran" in result.stdout
    assert "Unhandled monarch error on the root actor" in result.stderr and "constructor failed" in result.stderr


def test_fault_hook_that_raises_ends_a_script_that_ignores_sigint(tmp_path):
    """A script started in the background (SIGINT ignored, so no KeyboardInterrupt can reach its
    main thread) still ends when its fault hook raises: with SIGTERM."""
    result = _script(tmp_path, _SCRIPT_HEAD + """
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    """ + _FATAL_HOOK)
    assert result.returncode == -signal.SIGTERM and "not reached" not in result.stdout, result.stderr
    assert "SIGINT is ignored in this process: ending it with SIGTERM" in result.stderr


@pytest.mark.kernel
def test_fault_hook_in_a_kernel_prints_in_the_cell_and_the_kernel_lives(no_leaked_processes):
    from .jupyter_kernel import Kernel

    kernel = Kernel()
    try:
        kernel.ok("from monarch_nb.actor import Actor, endpoint, this_host\n"
                  "class Bad(Actor):\n"
                  "    def __init__(self):\n"
                  "        raise RuntimeError('constructor failed in a cell')\n"
                  "    @endpoint\n"
                  "    def x(self):\n"
                  "        pass\n"
                  "procs = this_host().spawn_procs(per_host={'gpus': 1})")
        cell = kernel.send("bad = procs.spawn('bad', Bad)")
        ex = kernel.collect(cell)
        assert ex.status == "ok"

        def printed(outs) -> bool:
            text = "".join(c.get("text", "") for t, c in ex.outputs + outs if t == "stream")
            return "unhandled failure of bad" in text and "constructor failed in a cell" in text

        outputs = kernel.drain(cell, timeout_s=T, until=printed)
        assert printed(outputs), ex.outputs + outputs
        assert kernel.ok("print(1 + 1)").stream_text("stdout").strip() == "2"  # the kernel lives
        no_leaked_processes.update(kernel.worker_pids())
        kernel.ok("procs.stop().get()")
    finally:
        kernel.shutdown()
