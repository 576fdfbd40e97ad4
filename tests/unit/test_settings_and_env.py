"""Settings from the environment, and the worker environment contract (ProcEnv / AgentEnv)."""

from __future__ import annotations

import pytest

import monarch_nb
from monarch_nb.config import Config
from monarch_nb.runtime.protocol import AgentEnv, Kind, ProcEnv


def test_config_reads_typed_values_from_the_environment(monkeypatch):
    monkeypatch.setenv("MONARCH_NB_HANG_TIMEOUT_S", "3.5")
    monkeypatch.setenv("MONARCH_NB_FENCE_HUNG", "no")
    monkeypatch.setenv("MONARCH_NB_TRANSPORT", "tcp")
    cfg = Config.from_env()
    assert (cfg.hang_timeout_s, cfg.fence_hung, cfg.transport) == (3.5, False, "tcp")
    assert Config().heartbeat_interval_s == 0.25


def test_configure_rejects_unknown_settings():
    with pytest.raises(TypeError, match="unknown setting.*hang_timeout"):
        monarch_nb.configure(hang_timout_s=1)


def test_proc_env_round_trips_and_sets_torchrun_variables():
    env = ProcEnv(controller="ipc:///tmp/x", rank=5, local_rank=1, world_size=8, local_world_size=4, group_rank=1,
                  coords={"hosts": 1, "gpus": 1}, extent={"hosts": 2, "gpus": 4}, heartbeat_interval_s=0.1,
                  sys_path=["/a"], key_hex="ab" * 16, agent_pid=77, extra={"MASTER_PORT": "1234"})
    environ = env.to_env()
    assert {k: environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1", "MASTER_PORT": "1234"}
    back = ProcEnv.from_env(environ)
    assert "MONARCH_NB_KEY" not in environ  # popped: the proc's children never see the key
    assert back == ProcEnv(**{**env.to_json(), "extra": {}})
    agent = AgentEnv("tcp://127.0.0.1:5", "cd" * 16, 99, "r1", 0.05)
    assert AgentEnv.from_env(agent.to_env()) == agent


def test_message_kinds_are_their_wire_strings():
    handlers = {Kind.CALL: "call handler"}
    assert handlers["call"] == "call handler" and Kind("hb") is Kind.HEARTBEAT and str(Kind.REPLY) == "reply"
