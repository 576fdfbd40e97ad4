"""Test helper: a real "Monarch (Python 3)" kernel driven through jupyter_client.

The kernelspec is installed into a temporary prefix (as ``monarch-nb install-kernel`` does) and
found through JUPYTER_PATH, so the tests use the same spec users get.
"""

from __future__ import annotations

import atexit
import os
import shutil
import queue
import tempfile
import time
from dataclasses import dataclass, field

from jupyter_client import KernelManager

_spec_prefix: str | None = None
#: the iopub message types an Execution keeps
OUTPUT_TYPES = ("stream", "display_data", "execute_result", "error", "update_display_data")


def kernelspec_prefix() -> str:
    """Install the kernelspec once per test session; return the JUPYTER_PATH entry to use."""
    global _spec_prefix
    if _spec_prefix is None:
        from monarch_nb.jupyter.kernelspec import install

        prefix = tempfile.mkdtemp(prefix="mnb-kernelspec-")
        atexit.register(shutil.rmtree, prefix, True)  # the suite leaves no folder behind
        install(prefix=prefix)
        _spec_prefix = os.path.join(prefix, "share", "jupyter")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in [_spec_prefix, os.environ.get("JUPYTER_PATH", "")] if p)
    return _spec_prefix


@dataclass
class Execution:
    """What one execute_request produced."""

    msg_id: str
    status: str = ""
    outputs: list = field(default_factory=list)  # (msg_type, content)
    reply: dict = field(default_factory=dict)
    reply_time: float = 0.0

    def stream_text(self, name: str | None = None) -> str:
        return "".join(c["text"] for t, c in self.outputs if t == "stream" and (name is None or c["name"] == name))

    def displays(self) -> list[dict]:
        return [c["data"] for t, c in self.outputs if t in ("display_data", "execute_result")]

    def updates(self, display_id: str | None = None) -> list[dict]:
        """The data of the update_display_data messages (of ``display_id``), in order."""
        return [c["data"] for t, c in self.outputs if t == "update_display_data"
                and (display_id is None or c.get("transient", {}).get("display_id") == display_id)]

    def display_ids(self) -> list[str]:
        """The display ids of the displays this execution created, in order."""
        return [c["transient"]["display_id"] for t, c in self.outputs
                if t == "display_data" and c.get("transient", {}).get("display_id")]

    @property
    def error(self) -> dict | None:
        for t, c in self.outputs:
            if t == "error":
                return c
        return None


class Kernel:
    """A started kernel: ``execute(code)`` returns an :class:`Execution` once the kernel is idle."""

    def __init__(self, extra_env: dict | None = None, cwd: str | None = None) -> None:
        kernelspec_prefix()
        env = dict(os.environ)
        env.update(extra_env or {})
        self.km = KernelManager(kernel_name="monarch")
        self.km.start_kernel(env=env, cwd=cwd or os.getcwd())
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pending: dict[str, list] = {}

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout_s: float = 60.0, until_idle: bool = True) -> Execution:
        """Gather iopub messages of ``msg_id`` until its idle status, and its reply."""
        ex = Execution(msg_id)
        deadline = time.monotonic() + timeout_s
        ex.outputs = self.pending.pop(msg_id, [])
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no idle status for {msg_id} within {timeout_s} s; got {ex.outputs[-5:]}")
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id")
            kind = msg["msg_type"]
            if parent != msg_id:
                if kind in OUTPUT_TYPES:
                    self.pending.setdefault(parent, []).append((kind, msg["content"]))
                continue
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                break
            if kind in OUTPUT_TYPES:
                ex.outputs.append((kind, msg["content"]))
        while True:
            reply = self.kc.get_shell_msg(timeout=max(1.0, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        ex.reply = reply["content"]
        ex.status = reply["content"]["status"]
        ex.reply_time = time.monotonic()
        return ex

    def drain(self, msg_id: str, timeout_s: float = 0.5, until=None) -> list:
        """Outputs that arrived for ``msg_id`` after its idle status (a background cell's): read
        for ``timeout_s``, or until ``until(outputs)`` holds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until is not None and until(self.pending.get(msg_id, [])):
                break
            try:
                msg = self.kc.get_iopub_msg(timeout=0.05)
            except queue.Empty:
                continue
            if msg["msg_type"] in OUTPUT_TYPES:
                self.pending.setdefault(msg["parent_header"].get("msg_id"), []).append((msg["msg_type"], msg["content"]))
        return self.pending.get(msg_id, [])

    def send_comm(self, comm_id: str, data: dict) -> None:
        """Send a comm message to the kernel, as a widget's view does when a button is clicked."""
        msg = self.kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
        self.kc.shell_channel.send(msg)

    def execute(self, code: str, timeout_s: float = 60.0) -> Execution:
        return self.collect(self.send(code), timeout_s)

    def ok(self, code: str, timeout_s: float = 60.0) -> Execution:
        ex = self.execute(code, timeout_s)
        assert ex.status == "ok", f"{code!r} failed: {ex.error or ex.outputs}"
        return ex

    def worker_pids(self) -> list[int]:
        ex = self.ok(
            "from monarch_nb.runtime.controller import Controller as _C\n"
            "_c = _C.existing()\n"
            "print(_c.pids() if _c else [])"
        )
        return eval(ex.stream_text("stdout").strip().splitlines()[-1])

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)
