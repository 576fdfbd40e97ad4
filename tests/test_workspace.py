"""Local code on the mesh's hosts: ``sync_workspace`` / ``%mesh sync``.

On this machine (real procs, one host): a folder that is not on any proc's path becomes
importable, changed modules reload in running procs (and a broken one keeps its old code),
restarted procs and warm spares import the new code, removals reach the copy. On two namespace
hosts whose mount namespace hides the notebook's folder (an empty tmpfs over it, as on machines
that share no filesystem): a kernel's ``%%mesh`` cell imports a module next to the notebook only
after ``%mesh sync``, sees its change after ``%mesh sync --reload``, a torchrun script of the
folder runs, fails, restarts and is debugged there, and a host whose agent was killed is given
the workspace again by itself.
"""

from __future__ import annotations

import os
import re
import shutil
import signal

import pytest

import monarch_nb
from monarch_nb import Actor, endpoint
from monarch_nb.errors import ActorError
from monarch_nb.runtime.controller import Controller
from monarch_nb.runtime.workspace_files import WorkspaceTooLarge
from monarch_nb.transport.keys import create_keys

from .conftest import pid_alive, wait_until
from .netns_cluster import NetnsCluster, require_namespaces

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ddp_script.py")


class Importer(Actor):
    @endpoint
    def values(self) -> dict:
        import wsmod_a
        import wspkg_a

        return {"value": wsmod_a.VALUE, "inner": wspkg_a.inner.f(), "file": wsmod_a.__file__}


class SharedImporter(Actor):
    @endpoint
    def values(self) -> dict:
        import wsshared_b

        return {"value": wsshared_b.VALUE, "file": wsshared_b.__file__}


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def project(tmp_path):
    root = tmp_path / "project"
    _write(root / "wsmod_a.py", "VALUE = 1\n")
    _write(root / "wspkg_a" / "__init__.py", "from . import inner\n")
    _write(root / "wspkg_a" / "inner.py", "def f():\n    return 'first'\n")
    _write(root / "results" / "big.bin", "x" * 10_000)
    _write(root / ".gitignore", "results/\n")
    return root


def test_a_synced_folder_imports_reloads_and_reaches_restarted_procs_and_spares(project, no_leaked_processes):
    procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2}, spares=1)
    try:
        ctrl = Controller.get()
        no_leaked_processes.update(r.pid for r in ctrl.mesh_records(procs.name))
        actors = procs.spawn("importer", Importer)
        with pytest.raises(ActorError, match="No module named 'wspkg_a'|No module named 'wsmod_a'"):
            actors.slice(gpus=0).values.call_one().get(timeout=30)

        done = procs.sync_workspace(project)
        assert done.files == 4 and done.total_bytes < 1000, "results/ is ignored by its .gitignore"
        (host,) = done.hosts
        assert host.host == "host0" and sorted(host.written) == [".gitignore", "wsmod_a.py", "wspkg_a/__init__.py",
                                                                 "wspkg_a/inner.py"]
        got = actors.values.call().get(timeout=30).values()
        assert [v["value"] for v in got] == [1, 1] and all(v["file"] == os.path.join(host.root, "wsmod_a.py") for v in got)

        _write(project / "wsmod_a.py", "VALUE = 2\n")
        _write(project / "wspkg_a" / "inner.py", "def f():\n    return 'second'\n")
        done = procs.sync_workspace(project, auto_reload=True)
        assert sorted(done.hosts[0].written) == ["wsmod_a.py", "wspkg_a/inner.py"]
        assert [(r.rank, sorted(r.reloaded), dict(r.failed)) for r in done.reloads] == \
            [(0, ["wsmod_a", "wspkg_a.inner"], {}), (1, ["wsmod_a", "wspkg_a.inner"], {})]
        assert [(v["value"], v["inner"]) for v in actors.values.call().get(timeout=30).values()] == [(2, "second")] * 2

        again = procs.sync_workspace(project, auto_reload=True)
        assert again.hosts[0].written == () and [r.reloaded for r in again.reloads] == [(), ()]
        assert "nothing changed" in again.summary()

        _write(project / "wsmod_a.py", "VALUE = (\n")
        broken = procs.sync_workspace(project, auto_reload=True)
        assert set(broken.failed_reloads) == {(procs.name, 0), (procs.name, 1)}
        assert "SyntaxError" in broken.failed_reloads[(procs.name, 0)]["wsmod_a"] and "SyntaxError" in broken.summary()
        assert [v["value"] for v in actors.values.call().get(timeout=30).values()] == [2, 2], "the old module stays"
        _write(project / "wsmod_a.py", "VALUE = 4\nraise RuntimeError('boom at import')\n")
        broken = procs.sync_workspace(project, auto_reload=True)
        assert "RuntimeError: boom at import" in broken.failed_reloads[(procs.name, 1)]["wsmod_a"]
        assert [v["value"] for v in actors.values.call().get(timeout=30).values()] == [2, 2], \
            "what ran of the new code before it raised is undone"

        _write(project / "wsmod_a.py", "VALUE = 3\n")
        _write(project / "extra_a.py", "X = 1\n")
        fixed = procs.sync_workspace(project, auto_reload=True)
        assert all("wsmod_a" in r.reloaded for r in fixed.reloads), "a module whose reload failed is tried again"
        os.remove(project / "extra_a.py")
        assert procs.sync_workspace(project).hosts[0].removed == ("extra_a.py",)
        assert not os.path.exists(os.path.join(host.root, "extra_a.py"))

        # a restart takes the warm spare (spawned before the first sync): it imports the new code
        before = ctrl.proc_record(procs.name, 1).pid
        procs.restart(1)
        assert ctrl.proc_record(procs.name, 1).pid != before
        assert actors.slice(gpus=1).values.call_one().get(timeout=30)["value"] == 3
        procs.restart(0)  # the spare's replacement, or a fresh proc: the same
        assert actors.slice(gpus=0).values.call_one().get(timeout=30)["value"] == 3
        no_leaked_processes.update(r.pid for r in ctrl.mesh_records(procs.name))
    finally:
        procs.stop()


def test_modules_imported_from_the_controllers_own_folder_reload_from_the_copy(project, no_leaked_processes):
    """A proc sharing the controller's filesystem may import the folder itself before any sync
    (the notebook's folder is on its path): after a sync, reload and restart alike run the copy."""
    import sys

    _write(project / "wsshared_b.py", "VALUE = 1\n")  # a name no other test syncs: the host's copy never had it
    sys.path.insert(0, str(project))
    try:
        procs = monarch_nb.this_host().spawn_procs(per_host={"gpus": 2})
    finally:
        sys.path.remove(str(project))
    try:
        no_leaked_processes.update(r.pid for r in Controller.get().mesh_records(procs.name))
        actors = procs.spawn("shared", SharedImporter)
        got = actors.values.call().get(timeout=30).values()
        assert [v["file"] for v in got] == [str(project / "wsshared_b.py")] * 2
        _write(project / "wsshared_b.py", "VALUE = 7\n")
        done = procs.sync_workspace(project, auto_reload=True, exclude="results/")
        assert all("wsshared_b" in r.reloaded for r in done.reloads), done.summary()
        copy = os.path.join(done.hosts[0].root, "wsshared_b.py")
        assert [(v["value"], v["file"]) for v in actors.values.call().get(timeout=30).values()] == [(7, copy)] * 2
        procs.restart(1)
        assert actors.slice(gpus=1).values.call_one().get(timeout=30)["file"] == copy
        no_leaked_processes.update(r.pid for r in Controller.get().mesh_records(procs.name))
    finally:
        procs.stop()


def test_bad_input_is_refused_before_anything_is_sent(project, tmp_path):
    hosts = monarch_nb.this_host()
    for bad, error in ((dict(max_bytes="x"), "max_bytes must be a positive int"), (dict(timeout_s=0), "timeout_s must be"),
                       (dict(max_files=-1), "max_files must be"), (dict(exclude=[3]), "exclude takes")):
        with pytest.raises((TypeError, ValueError), match=error):
            hosts.sync_workspace(project, **bad)
    with pytest.raises(TypeError, match="a folder's path"):
        hosts.sync_workspace(None)
    with pytest.raises(NotADirectoryError, match="no folder"):
        hosts.sync_workspace(tmp_path / "missing")
    with pytest.raises(WorkspaceTooLarge, match=r"the largest: wspkg_a/inner\.py"):
        hosts.sync_workspace(project, max_bytes=10)
    with pytest.raises(ValueError, match="unknown host 'nowhere'"):
        monarch_nb.HostMesh(["nowhere"]).sync_workspace(project)


# -- two namespace hosts without the notebook's folder ------------------------------------------------

@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    return tmp_path_factory.mktemp("notebook")


@pytest.fixture(scope="module")
def hidden_cluster(tmp_path_factory, notebook):
    require_namespaces()
    keys = create_keys(str(tmp_path_factory.mktemp("keys") / "cluster"))
    hosts = NetnsCluster(2, keys, hide=(str(notebook),)).start()
    yield hosts
    hosts.close()


@pytest.mark.kernel
@pytest.mark.timeout(400)
def test_a_notebooks_module_reaches_hosts_that_never_had_it(hidden_cluster, notebook, tmp_path):
    from .jupyter_kernel import Kernel
    from .test_debug import ok

    _write(notebook / "helper_mod.py", "VALUE = 1\n")
    shutil.copy(SCRIPT, notebook / "train_ddp.py")
    kernel = Kernel(cwd=str(notebook), extra_env={"MONARCH_NB_HANG_TIMEOUT_S": "3.0"})
    pids: list[int] = []
    try:
        first, second = hidden_cluster.addresses
        kernel.ok(f"procs = %mesh start 1 --hosts {first},{second} --ca {hidden_cluster.ca}", 120)
        pids = kernel.worker_pids()
        seen = kernel.ok(f"%%mesh\nimport os\nprint('sees', os.listdir({str(notebook)!r}))", 60).stream_text()
        assert re.findall(r"sees (\[.*\])", seen) == ["[]", "[]"], f"the hosts must not see the notebook's folder: {seen}"
        missing = kernel.execute("%%mesh\nimport helper_mod", 60)
        assert "No module named 'helper_mod'" in missing.stream_text() + str(missing.error)

        synced = kernel.ok("%mesh sync", 60).stream_text()
        assert f"synced {notebook}: 2 files" in synced and "to 2 host(s)" in synced and "helper_mod.py" in synced, synced
        ex = kernel.ok("%%mesh\nimport helper_mod\nprint('value', rank, helper_mod.VALUE)", 60)
        assert sorted(re.findall(r"value (\d) (\d)", ex.stream_text())) == [("0", "1"), ("1", "1")], ex.stream_text()

        _write(notebook / "helper_mod.py", "VALUE = 2\n")
        _write(notebook / "helper_two.py", "X = 20\n")
        synced = kernel.ok("%mesh sync --reload", 60).stream_text()
        assert "written: helper_mod.py, helper_two.py" in synced and "reloaded on 2 proc(s): helper_mod" in synced, synced
        ex = kernel.ok("%%mesh\nimport helper_two\nprint('value', rank, helper_mod.VALUE + helper_two.X)", 60)
        assert sorted(re.findall(r"value (\d) (\d+)", ex.stream_text())) == [("0", "22"), ("1", "22")], ex.stream_text()

        # a torchrun script of the folder: run, failed, restarted, debugged, on both hosts
        marker = tmp_path / "marker"
        ran = kernel.ok(f"%mesh run --max-restarts 1 train_ddp.py 3 --fail-at 1:1:raise --marker {marker}", 180).stream_text()
        assert "train_ddp.py ended on all 2 ranks" in ran and "after 1 restart(s)" in ran, ran
        assert "[0] done" in ran and "[1] done" in ran, ran
        os.remove(marker)
        failed = kernel.ok(f"%mesh run train_ddp.py 3 --fail-at 1:1:raise --marker {marker}", 180).stream_text("stderr")
        assert "train_ddp.py failed on rank 1" in failed, failed
        post_mortem = ok(kernel, "%mesh debug 1", ["p step", "p __file__", "q"], 60).text
        assert "1\n" in post_mortem and "/workspace/train_ddp.py" in post_mortem, post_mortem

        # a host whose agent dies gets a new agent from its worker loop, and the workspace again
        agent = int(kernel.ok("from monarch_nb.runtime.controller import Controller\n_c = Controller.get()\n"
                              "print(_c.hosts[_c.proc_record(procs.name, 1).host].pid)").stream_text())
        os.kill(agent, signal.SIGKILL)
        wait_until(lambda: not pid_alive(agent), 10, message="the killed agent gone")
        back = kernel.ok("import time\n_h = _c.hosts[_c.proc_record(procs.name, 1).host]\n_t = time.monotonic() + 60\n"
                         f"while not (_h.state == 'healthy' and _h.pid not in (0, {agent})) and time.monotonic() < _t:\n"
                         "    time.sleep(0.05)\nprint('host back', _h.state, _h.pid)", 90).stream_text()
        assert "host back healthy" in back, back
        assert "restarted" in kernel.ok("%mesh restart 1", 120).stream_text()
        ex = kernel.ok("%%mesh --ranks 1\nimport helper_mod, helper_two\nprint('again', helper_mod.VALUE, helper_two.X)", 60)
        assert "again 2 20" in ex.stream_text(), ex.stream_text()
        kernel.ok("%mesh stop", 60)
    finally:
        pids += kernel.worker_pids()
        kernel.shutdown()
    wait_until(lambda: not [p for p in pids if pid_alive(p)], 30, message=f"kernel's procs and agents {pids} gone")
