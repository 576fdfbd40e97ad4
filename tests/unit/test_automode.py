"""The extension's input transformer: auto mode and awaitable waits (no kernel needed)."""

from __future__ import annotations

import pytest

from monarch_nb.jupyter import automode


@pytest.fixture(autouse=True)
def mode_off():
    automode.MODE.on, automode.MODE.ranks = False, None
    yield
    automode.MODE.on, automode.MODE.ranks = False, None


def test_auto_mode_sends_code_cells_to_the_ranks_and_keeps_magics_local():
    class Shell:
        prompts = None

    automode.set_mode(Shell(), True, "0,2")
    assert automode.transform(["x = 1\n"]) == ["%%mesh --ranks 0,2\n", "x = 1\n"]
    assert automode.transform(["# a comment\n", "x = 1\n"])[0].startswith("%%mesh")
    for local in (["%mesh status\n"], ["!ls\n"], ["%%time\n", "x = 1\n"], ["\n"]):
        assert automode.transform(local) == local
    once = automode.transform(["x = 1\n"])
    assert automode.transform(once) == once  # IPython may transform a cell twice
    automode.set_mode(Shell(), False)
    assert automode.transform(["x = 1\n"]) == ["x = 1\n"]


def test_top_level_waits_become_awaits_and_indented_ones_stay():
    out = automode.transform(["%mesh wait run --step 5\n", "%mesh barrier\n", "for i in range(2):\n", "    %mesh wait\n"])
    assert out[0].startswith("await ") and "'wait run --step 5'" in out[0]
    assert out[1].startswith("await ") and "'barrier'" in out[1]
    assert out[2:] == ["for i in range(2):\n", "    %mesh wait\n"]
    assert automode.transform(["%%mesh\n", "%mesh wait\n"]) == ["%%mesh\n", "%mesh wait\n"]  # a cell magic's body
    assert automode.transform(["%mesh waiting_room\n"]) == ["%mesh waiting_room\n"]


def test_a_terminal_prompt_shows_the_mode():
    class Prompts:
        def in_prompt_tokens(self):
            return [("Token.Prompt", "In [1]: ")]

    class Shell:
        prompts = Prompts()

    shell = Shell()
    automode.set_mode(shell, True)
    assert [text for _, text in shell.prompts.in_prompt_tokens()] == ["[mesh] ", "In [1]: "]
    automode.set_mode(shell, False)
    assert [text for _, text in shell.prompts.in_prompt_tokens()] == ["In [1]: "]
