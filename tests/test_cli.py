"""Operator mistakes at the ``monarch-nb`` command: each is one line on stderr that names the fix,
exit status 2, never a traceback or a page of usage. Run as a user runs it: a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import zmq

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monarch_nb.cli", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def _one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    err = result.stderr.strip()
    assert result.returncode == 2, (result.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "usage:" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def busy_port():
    """A port something already listens on (a ZeroMQ socket of this test)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield port
    sock.close(0)


def test_a_worker_on_a_port_in_use_says_so(busy_port):
    _one_line_error(_run("worker", "--address", f"tcp://127.0.0.1:{busy_port}"), "already in use", "another port")


@pytest.mark.parametrize("address, needle", [
    ("tcp://127.0.0.1:99999", "a number from 0 to 65535"),
    ("127.0.0.1:26600", "must look like tcp://HOST:PORT"),
    ("tcp://10.254.254.1:26600", "without a cluster key"),
])
def test_a_worker_with_a_bad_address_says_what_to_write(address, needle):
    _one_line_error(_run("worker", "--address", address), needle)


def test_a_worker_with_missing_keys_says_how_to_make_them(tmp_path):
    _one_line_error(_run("worker", "--address", "tcp://127.0.0.1:0", "--curve-keys", str(tmp_path / "nope")),
                    "monarch-nb keys")


@pytest.mark.parametrize("argv, needle", [
    (["train", "--procs", "0"], "must be a positive integer, got 0"),
    (["train", "--workload", "imagenet"], "invalid choice: 'imagenet'"),
    (["demo", "--steps", "x"], "must be a positive integer, got 'x'"),
    (["tour", "--procs", "-1"], "must be a positive integer"),
    (["report"], "the following arguments are required: FILE.json"),
])
def test_bad_arguments_are_one_line_naming_help(argv, needle):
    _one_line_error(_run(*argv), needle, f"see monarch-nb {argv[0]} --help")


def test_a_kernelspec_that_cannot_be_written_names_another_place(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    _one_line_error(_run("install-kernel", "--prefix", str(blocker / "prefix")), "cannot write the kernelspec", "--user")


def test_a_report_that_is_missing_or_not_a_report(tmp_path):
    _one_line_error(_run("report", str(tmp_path / "missing.json")), "No such file")
    (tmp_path / "bad.json").write_text("[1, 2]")
    _one_line_error(_run("report", str(tmp_path / "bad.json")), "not a training report")


def test_train_with_a_job_file_that_is_not_there():
    _one_line_error(_run("train", "--job", "/nonexistent/job_state.json"), "no such file", "job.state()")
