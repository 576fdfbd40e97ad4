"""The debugger: post-mortem pdb, breakpoints, live stacks, through a real kernel (jupyter_client).

pdb commands are typed the way a notebook user types them: the kernel's ``input()`` sends an
input request on the stdin channel, and the test answers it (:func:`run_with_input`).
"""

from __future__ import annotations

import queue
import re
import time

import pytest

import monarch_nb
from monarch_nb.debug import client
from monarch_nb.debug.magic import parse_ranks
from monarch_nb.debug.stacks import format_stack
from monarch_nb.supervision.records import ProcState

from .conftest import pid_alive, wait_until
from .jupyter_kernel import Kernel

pytestmark = pytest.mark.timeout(150)


class Run:
    """What one cell printed, the input prompts it showed and how it ended."""

    def __init__(self) -> None:
        self.text = ""
        self.prompts: list[str] = []
        self.status = ""
        self.error: dict | None = None


def run_with_input(kernel: Kernel, code: str, answers: list[str] = (), timeout_s: float = 60.0) -> Run:
    """Execute ``code``; answer each input request with the next of ``answers`` (fails if they
    run out or are not all used)."""
    answers = list(answers)
    kc = kernel.kc
    msg_id = kc.execute(code, allow_stdin=True)
    run = Run()
    chunks: list[str] = []
    deadline = time.monotonic() + timeout_s
    idle = False
    extra_prompts = []
    while not idle:
        if time.monotonic() > deadline:
            raise AssertionError(f"cell did not finish within {timeout_s} s; output so far:\n{''.join(chunks)}")
        try:
            msg = kc.get_stdin_msg(timeout=0.01)
        except queue.Empty:
            msg = None
        if msg is not None and msg["msg_type"] == "input_request":
            run.prompts.append(msg["content"]["prompt"])
            if answers:
                kc.input(answers.pop(0))
            else:
                extra_prompts.append(msg["content"]["prompt"])
                kc.input("quit")
        while True:
            try:
                msg = kc.get_iopub_msg(timeout=0.01)
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                chunks.append(msg["content"]["text"])
            elif kind in ("execute_result", "display_data"):
                chunks.append(msg["content"]["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                run.error = msg["content"]
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
    while True:
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    run.status = reply["content"]["status"]
    run.text = "".join(chunks)
    assert not extra_prompts, f"unexpected input prompts {extra_prompts}; output:\n{run.text}"
    assert not answers, f"answers left unused: {answers}; output:\n{run.text}"
    return run


def ok(kernel: Kernel, code: str, answers: list[str] = (), timeout_s: float = 60.0) -> Run:
    run = run_with_input(kernel, code, answers, timeout_s)
    assert run.status == "ok", f"{code!r} failed: {run.error}\n{run.text}"
    return run


def line_of(source: str, needle: str) -> int:
    """1-based number of the line of ``source`` that contains ``needle`` (as the kernel numbers it)."""
    return next(i for i, line in enumerate(source.split("\n"), 1) if needle in line)


def in_order(text: str, *parts: str) -> None:
    """Assert that ``parts`` occur in ``text`` in this order."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} not found (in order) in:\n{text}"
        at = found + len(part)


SETUP = """import time
import monarch_nb
monarch_nb.configure(heartbeat_interval_s=0.1, hang_timeout_s=2.0)
from monarch_nb import Actor, endpoint, current_rank
from monarch_nb.runtime.controller import Controller
%mesh start 3
from monarch_nb.jupyter import session as _session
procs = _session.current().procs

def wait_paused(n, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while sum(bool(r.paused) for r in Controller.get().procs.values()) < n:
        assert time.monotonic() < deadline, "ranks did not pause"
        time.sleep(0.02)
"""

ACTORS = """def helper(z):
    inner = z + 1
    raise ValueError(f"bad value {inner}")

class Worker(Actor):
    @endpoint
    def fail(self, v):
        local_marker = v * 2
        return helper(local_marker)

    @endpoint
    def echo(self, v):
        return v

    @endpoint
    def step(self, n):
        x = n * 10 + current_rank().rank
        breakpoint()
        y = x + 1
        return y

workers = procs.spawn("workers", Worker)
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    pids: list[int] = []
    try:
        ok(k, SETUP)
        ok(k, ACTORS)
        yield k
        pids = k.worker_pids()
    finally:
        k.shutdown()
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 10.0, message=f"kernel's workers {pids} gone")


def test_post_mortem_p_up_l_and_q_leaves_rank_usable(kernel):
    ok(kernel, "try:\n    workers.slice(gpus=1).fail.call_one(20).get(10)\n"
               "except monarch_nb.ActorError as e:\n    print('failed:', e.exception_type)")
    run = ok(kernel, "%mesh debug 1", ["p inner", "up", "p local_marker", "l", "w", "q"])
    assert run.prompts == ["[rank 1] (Pdb) "] * 6
    text = run.text
    in_order(
        text,
        "rank 1 (gpus=1)", "post-mortem", "ValueError: bad value 41", "device: cpu",
        "helper()", 'raise ValueError(f"bad value {inner}")',  # the banner: innermost frame, cell source
        "41",                                                     # p inner
        "fail()", "return helper(local_marker)",                  # up
        "40",                                                     # p local_marker
        "local_marker = v * 2",                                   # l shows the cell's source
        "post-mortem session ended",                              # q
    )
    usable = ok(kernel, "print('echo', workers.slice(gpus=1).echo.call_one(7).get(10))")
    assert "echo 7" in usable.text
    listing = ok(kernel, "%mesh debug list").text
    raise_line = line_of(ACTORS, "raise ValueError")
    assert re.search(rf"^1\s+gpus=1\s+failed\s+workers\s+fail\s+helper \(.*:{raise_line}\)", listing, re.M), listing
    assert "session open" not in listing


def test_debug_prompt_attach_detach_and_come_back(kernel):
    ok(kernel, "try:\n    workers.slice(gpus=1).fail.call_one(3).get(10)\nexcept monarch_nb.ActorError:\n    pass")
    run = ok(kernel, "%mesh debug", ["attach 1", "p inner", "up", "detach", "list", "quit"])
    assert run.prompts == ["monarch_nb debug> ", "[rank 1] (Pdb) ", "[rank 1] (Pdb) ", "[rank 1] (Pdb) ",
                           "monarch_nb debug> ", "monarch_nb debug> "]
    in_order(run.text, "failed", "post-mortem", "7", "fail()", "detached from rank 1", "session open")
    back = ok(kernel, "%mesh debug 1", ["p local_marker", "q"])  # the open session, still on the caller's frame
    in_order(back.text, "fail()", "6", "post-mortem session ended")


def test_interact_runs_in_the_failed_frame(kernel):
    ok(kernel, "try:\n    workers.slice(gpus=1).fail.call_one(5).get(10)\nexcept monarch_nb.ActorError:\n    pass")
    run = ok(kernel, "%mesh debug 1", ["interact", "print(inner * 2)", "inner + 1000", "exit()", "c"])
    assert run.prompts == ["[rank 1] (Pdb) ", "[rank 1] >>> ", "[rank 1] >>> ", "[rank 1] >>> ", "[rank 1] (Pdb) "]
    in_order(run.text, "*interactive*", "22", "1011", "back in pdb", "post-mortem session ended")


def test_frame_cell_runs_in_the_failed_frame(kernel):
    ok(kernel, "try:\n    workers.slice(gpus=1).fail.call_one(30).get(10)\nexcept monarch_nb.ActorError:\n    pass")
    run = ok(kernel, "%%mesh --ranks 1 --frame\nprint('in frame', inner, z)\nextra = inner + 1")
    assert "in frame 61 60" in run.text
    assert "62" in ok(kernel, "%%mesh --ranks 1 --frame\nprint(extra)").text  # the namespace persists


def test_a_failed_mesh_cell_can_be_debugged_post_mortem(kernel):
    failed = run_with_input(kernel, "%%mesh --ranks 2\ncell_local = 17\nraise RuntimeError('cell broke')")
    assert failed.status == "error" and "cell broke" in failed.text + str(failed.error)
    run = ok(kernel, "%mesh debug 2", ["p cell_local", "q"])
    in_order(run.text, "rank 2", "RuntimeError: cell broke", "17", "post-mortem session ended")


def test_breakpoint_on_two_ranks_cast_and_continue(kernel):
    ok(kernel, "pair = workers.slice(gpus=slice(0, 2))\nfut = pair.step.call(4)\nwait_paused(2)")
    run = ok(kernel, "%mesh debug", ["cast 0,1 p x", "continue"])
    assert run.prompts == ["monarch_nb debug> "] * 2
    in_order(run.text, "paused", "step", "--- rank 0 ---", "40", "--- rank 1 ---", "41", "rank 0:", "continues", "rank 1:", "continues")
    stop_line = line_of(ACTORS, "y = x + 1")  # pdb stops on the line after breakpoint()
    assert re.search(rf"^0\s+gpus=0\s+paused\s+workers\s+step\s+step \(.*:{stop_line}\)", run.text, re.M), run.text
    result = ok(kernel, "print('result', fut.get(10).values())")
    assert "result [41, 42]" in result.text
    assert "paused" not in ok(kernel, "%mesh debug list").text


COLLECTIVE = """import datetime
import torch
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 4, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))

def spin():
    n = 0
    while True: n += 1

class Collective(Actor):
    @endpoint
    def run(self, port):
        rank = current_rank().rank
        peers = dist.TCPStore("127.0.0.1", port, 3, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=peers, rank=rank, world_size=3)
        if rank == 2:
            spin()
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

hang_procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 3})
hang = hang_procs.spawn("hang", Collective)
hang_fut = hang.run.call(store.port)
print(hang_procs.name)
"""


def test_stack_names_busy_loop_and_collective(kernel):
    mesh = ok(kernel, COLLECTIVE, timeout_s=90).text.strip().splitlines()[-1]
    wanted = re.compile(r"in spin\n\s+while True: n \+= 1", re.M)
    in_all_reduce = re.compile(rf'line {line_of(COLLECTIVE, "dist.all_reduce(t)")}, in run\n\s+dist.all_reduce\(t\)')
    deadline = time.monotonic() + 60
    while True:
        text = ok(kernel, f"%mesh stack --mesh {mesh}").text
        groups = text.split("\n\n")
        collective = next((g for g in groups if g.startswith("ranks 0,1 (2 ranks, identical stacks)")), "")
        if wanted.search(text) and in_all_reduce.search(collective):
            break  # both ranks reached all_reduce (before that, both may still be in init_process_group)
        assert time.monotonic() < deadline, f"stacks never showed the hang:\n{text}"
        time.sleep(0.5)
    assert in_all_reduce.search(collective), collective
    assert "all_reduce" in collective and "spin" not in collective
    looping = next(g for g in groups if g.startswith("rank 2"))
    assert re.search(rf'line {line_of(COLLECTIVE, "            spin()")}, in run\n\s+spin\(\)', looping), looping
    assert re.search(rf"line {line_of(COLLECTIVE, 'while True: n += 1')}, in spin", looping), looping
    one = ok(kernel, f"%mesh stack 2 --mesh {mesh}").text
    assert one.startswith("rank 2 (gpus=2)") and re.search(r"in spin\n\s+while True: n \+= 1", one), one
    assert "[in run for " in one  # a single rank shows how long the endpoint has run
    ok(kernel, "hang_procs.stop()", timeout_s=30)


def test_bad_input_says_what_is_available(kernel):
    ok(kernel, "try:\n    workers.slice(gpus=1).fail.call_one(1).get(10)\nexcept monarch_nb.ActorError:\n    pass")
    nothing = ok(kernel, "%mesh debug 0").text
    assert "rank 0: no failure or breakpoint to debug" in nothing and "Available: rank 1 (failed in helper" in nothing
    unknown = ok(kernel, "%mesh debug 9").text
    assert "no rank 9 in proc mesh 'pm0' (ranks 0..2)" in unknown and "Available: rank 1" in unknown
    bad_cast = ok(kernel, "%mesh debug cast 0-5 p 1").text
    assert "not in the mesh: valid ranks are 0..2" in bad_cast
    ok(kernel, "%mesh fault kill 2\nwait_dead = time.monotonic() + 10\n"
               "while Controller.get().proc_record('pm0', 2).alive and time.monotonic() < wait_dead:\n    time.sleep(0.02)")
    dead = ok(kernel, "%mesh debug 2").text
    assert "rank 2 is dead: killed by SIGKILL" in dead and "Available: rank 1" in dead
    assert "dead" in ok(kernel, "%mesh stack 2").text
    assert re.search(r"^2\s+gpus=2\s+dead", ok(kernel, "%mesh debug list").text, re.M)
    help_text = ok(kernel, "%mesh debug help").text
    assert "cast RANKS CMD" in help_text


# -- without a kernel -------------------------------------------------------------------------------
def test_parse_ranks():
    assert parse_ranks("0,2", 4) == [0, 2]
    assert parse_ranks("1-3", 4) == [1, 2, 3]
    assert parse_ranks("all", 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="valid ranks are 0..3"):
        parse_ranks("4", 4)
    with pytest.raises(ValueError, match="bad rank list"):
        parse_ranks("x", 4)


def test_api_post_mortem_session_and_errors(procs4):
    from .actors import Worker

    workers = procs4.spawn("w", Worker)
    workers.slice(gpus=2).echo.call_one(0).get(10)
    with pytest.raises(monarch_nb.ActorError):
        workers.slice(gpus=2).fail.call_one("boom").get(10)
    session = client.DebugSession(2, procs4)
    assert "post-mortem of failure 1" in session.banner and "ValueError: boom" in session.banner
    assert "device: " in session.banner
    assert session.command("p local_marker").strip() == "42"
    session.command("q")
    assert session.ended
    with pytest.raises(client.DebugError, match="has ended"):
        session.command("p 1")
    with pytest.raises(client.DebugError, match=r"rank 0: no failure or breakpoint to debug\. Available: rank 2"):
        client.DebugSession(0, procs4)
    with pytest.raises(client.DebugError, match=r"no rank 4 in proc mesh"):
        client.DebugSession(4, procs4)
    assert client.clear_failures(procs4) == {0: 0, 1: 0, 2: 1, 3: 0}
    with pytest.raises(client.DebugError, match="no failure or breakpoint"):
        client.DebugSession(2, procs4)


def test_stack_of_a_proc_whose_io_thread_is_stuck_comes_from_faulthandler(procs4):
    """A C call holding the GIL (the ``stall`` fault, on the IO thread): the channel cannot answer,
    so the stack is taken through SIGUSR1 and faulthandler."""
    from monarch_nb.runtime.controller import Controller

    saved = monarch_nb.configure().fence_hung
    monarch_nb.configure(fence_hung=False)
    try:
        rec = Controller.get().proc_record(procs4.name, 3)
        procs4.inject(3, "stall", seconds=3.0)
        wait_until(lambda: time.monotonic() - rec.last_heartbeat > 0.3, 5.0, message="rank 3 stalled")
        data = client.stack_data(procs4, [3], timeout_s=0.5)
        assert data[3]["source"] == "faulthandler", data
        text = format_stack(data[3])  # (the signal also ends the stall: usleep returns on EINTR)
        assert "faulthandler" in text and "in _hold_gil" in text, text
    finally:
        monarch_nb.configure(fence_hung=saved)
    wait_until(lambda: Controller.get().proc_record(procs4.name, 3).state in ("healthy", "busy"), 10.0, message="rank 3 serving again")


class Pauser(monarch_nb.Actor):
    @monarch_nb.endpoint
    def wait_here(self, value: int) -> int:
        kept = value * 3
        breakpoint()
        return kept

    @monarch_nb.endpoint
    def fail_on_device(self, megabytes: int) -> None:
        import torch

        from monarch_nb import device

        block = torch.ones(megabytes * (1 << 20) // 4, device=device.device())  # noqa: F841 - shown by the banner
        raise MemoryError("pretend out of memory")


class Interruptible(monarch_nb.Actor):
    """Has the ``__interrupt__`` hook the runtime calls for an "interrupt" message (as %%mesh cells do)."""

    def __interrupt__(self, thread_ident: int) -> None:
        import ctypes

        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_ident), ctypes.py_object(KeyboardInterrupt))

    @monarch_nb.endpoint
    def wait_here(self) -> int:
        breakpoint()
        return 1


def test_an_interrupt_ends_a_pause_like_it_ends_a_call(procs4):
    from monarch_nb.runtime.controller import Controller

    actors = procs4.spawn("interruptible", Interruptible)
    fut = actors.slice(gpus=2).wait_here.call_one()
    client.wait_paused(1, procs4, timeout_s=20)
    Controller.get().interrupt(procs4.name, 2, "interruptible")
    with pytest.raises(monarch_nb.ActorError) as info:
        fut.get(10)
    assert info.value.exception_type == "KeyboardInterrupt"
    failed = [t for t in client.debug_targets(procs4) if t.kind == "failed"]
    assert [(t.rank, t.function) for t in failed] == [(2, "wait_here")]  # the debugger's frames are cut
    assert not [t for t in client.debug_targets(procs4) if t.kind == "paused"]


def test_a_paused_rank_is_paused_not_hung(procs4):
    from monarch_nb.runtime.controller import Controller

    controller = Controller.get()
    pausers = procs4.spawn("pausers", Pauser)
    since = controller.events.next_seq
    fut = pausers.slice(gpus=1).wait_here.call_one(5)
    client.wait_paused(1, procs4, timeout_s=20)
    rec = controller.proc_record(procs4.name, 1)
    time.sleep(monarch_nb.configure().hang_timeout_s * 1.5)  # longer than a hang would be allowed
    assert rec.state == ProcState.BUSY and rec.paused and rec.paused[0]["function"] == "wait_here"
    kinds = [e.kind for e in controller.events.events(since_seq=since) if e.rank == 1]
    assert "proc_paused" in kinds and "proc_hung" not in kinds and "proc_fenced" not in kinds
    assert [t.rank for t in client.debug_targets(procs4) if t.kind == "paused"] == [1]
    from monarch_nb.supervision.tree import find

    (node,) = find(procs4.tree(), "proc", rank=1)
    assert node["state"] == "paused" and [a["state"] for a in node["children"]] == ["paused"]
    assert find(procs4.tree(), "proc", rank=0)[0]["state"] == "healthy"
    assert client.cast([1], "p kept") == {1: "15\n"}
    assert client.continue_all(procs4) == {1: "(the rank continues)\n"}
    assert fut.get(10) == 15
    wait_until(lambda: not rec.paused, 5.0, message="rank 1 no longer paused")
    assert "proc_continued" in [e.kind for e in controller.events.events(since_seq=since) if e.rank == 1]


def test_banner_shows_the_ranks_device_and_memory(procs4):
    """On a GPU host: the device's name and the memory torch holds there; on CPU: cpu and torch."""
    import torch

    pausers = procs4.spawn("gpu_users", Pauser)
    with pytest.raises(monarch_nb.ActorError, match="pretend out of memory"):
        pausers.slice(gpus=0).fail_on_device.call_one(64).get(60)
    banner = client.DebugSession(0, procs4).banner
    if torch.cuda.is_available():
        kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        match = re.search(rf"device: {kind} .+: (\d+\.\d+) GiB allocated, (\d+\.\d+) GiB reserved", banner)
        assert match and float(match.group(1)) >= 0.06, banner
    else:
        assert re.search(r"device: cpu \(torch \d", banner), banner
    client.cast([0], "q")


def test_device_line_for_gpus(monkeypatch):
    """The banner's device line for CUDA and ROCm (stand-in for hosts without a GPU)."""
    import torch

    from monarch_nb import device
    from monarch_nb.debug.worker import describe_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert describe_device().startswith(("cuda available, not used by this proc yet", "rocm available"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for kind in ("cuda", "rocm"):
        monkeypatch.setattr(device, "describe", lambda kind=kind: {
            "kind": kind, "name": "Some GPU", "memory_allocated_bytes": 3 << 30,
            "memory_reserved_bytes": 4 << 30, "torch": "2.x",
        })
        assert describe_device() == f"{kind} Some GPU: 3.00 GiB allocated, 4.00 GiB reserved (torch 2.x)"
