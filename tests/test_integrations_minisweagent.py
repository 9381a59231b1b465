"""guestd.integrations.minisweagent against the real mini-swe-agent (the integration venv
that scripts/test.sh builds; skipped where mini-swe-agent is not installed).

mini-swe-agent's own tests/environments/test_local.py constructs LocalEnvironment and
checks host state (os.environ, os.getcwd()), so it is not generic: its contract cases are
repeated here for GuestdEnvironment, plus a run of mini-swe-agent's default agent loop
(DefaultAgent, its built-in mini.yaml, its DeterministicModel) end to end on a real guestd.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("minisweagent")

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_path
from minisweagent.environments import get_environment
from minisweagent.models.test_models import DeterministicModel, make_output

from guestd.integrations.minisweagent import GuestdEnvironment
from guestd.testing.local import Guestd


@pytest.fixture
def env_at(guestd: Guestd) -> Iterator[Any]:
    made: list[GuestdEnvironment] = []

    def make(**kwargs: Any) -> GuestdEnvironment:
        e = GuestdEnvironment(address=guestd.address, **kwargs)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_contract(env_at: Any, tmp_path: Path) -> None:
    env = env_at(env={"TEST_VAR": "test_value", "OTHER": "x"})
    r = env.execute({"command": "echo hello $TEST_VAR $OTHER; echo err >&2"})
    assert r == {"output": "hello test_value x\nerr\n", "returncode": 0, "exception_info": ""}
    assert env.execute({"command": "exit 42"})["returncode"] == 42
    r = env.execute({"command": "nonexistent_command_12345"})
    assert r["returncode"] == 127 and "command not found" in r["output"]
    r = env.execute({"command": "echo $(echo nested) | grep nest"})
    assert r["output"] == "nested\n"
    # every command in a fresh shell: no state carries over
    env.execute({"command": "export KEEP=1; cd /"})
    assert env.execute({"command": "echo ${KEEP:-unset}"})["output"] == "unset\n"


def test_cwd(env_at: Any, tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env = env_at(cwd=str(tmp_path / "a"))
    assert env.execute({"command": "pwd"})["output"] == f"{tmp_path / 'a'}\n"
    assert env.execute({"command": "pwd"}, cwd=str(tmp_path / "b"))["output"] == f"{tmp_path / 'b'}\n"
    env.execute({"command": "echo 'test content' > test.txt"})
    assert (tmp_path / "a" / "test.txt").read_text() == "test content\n"


def test_timeout_is_structured_and_ends_the_tree(env_at: Any) -> None:
    env = env_at(timeout=1)
    r = env.execute({"command": "echo started; sleep 30 & sleep 30"})
    assert r["returncode"] == -1
    assert r["output"] == "started\n"
    assert "timed out" in r["exception_info"]
    assert r["extra"]["exception_type"] == "TimeoutExpired"
    assert env.execute({"command": "sleep 2"}, timeout=1)["returncode"] == -1


def test_template_vars_are_the_guests(env_at: Any) -> None:
    env = env_at(cwd="/tmp")
    v = env.get_template_vars(task="t")
    assert v["system"] == os.uname().sysname and v["machine"] == os.uname().machine
    assert v["cwd"] == "/tmp" and v["task"] == "t"
    assert env.serialize()["info"]["config"]["environment_type"].endswith("GuestdEnvironment")


def test_default_agent_loop_end_to_end(guestd: Guestd, tmp_path: Path) -> None:
    """mini-swe-agent's DefaultAgent with its own mini.yaml, a scripted model, the
    environment made from a config as ``mini`` would, on a real guestd: the model reads a
    bug, fixes it with sed, runs the test, submits the diff."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    config = yaml.safe_load(get_config_path("mini.yaml").read_text())
    env = get_environment(
        {
            "environment_class": "guestd.integrations.minisweagent.GuestdEnvironment",
            "address": guestd.address,
            "cwd": str(repo),
        }
    )
    assert isinstance(env, GuestdEnvironment)
    script = [
        ("Look at the code.", "cat calc.py"),
        ("Fix the operator.", "sed -i 's/a - b/a + b/' calc.py"),
        ("Test it.", "python3 -c 'import calc; assert calc.add(2, 3) == 5; print(\"ok\")'"),
        ("Submit.", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat calc.py"),
    ]
    model = DeterministicModel(  # type: ignore[no-untyped-call]
        outputs=[make_output(text, [{"command": cmd}], cost=0.0) for text, cmd in script],
        cost_per_call=0.0,
        observation_template=config["model"].get("observation_template", "{{output.output}}"),
    )
    agent = DefaultAgent(model, env, **{**config["agent"], "output_path": None})
    result = agent.run("add() subtracts")
    assert result["exit_status"] == "Submitted"
    assert result["submission"] == "def add(a, b):\n    return a + b\n"
    observations = [m["content"] for m in agent.messages if m.get("role") in ("user", "tool")][1:]
    assert "return a - b" in str(observations[0])
    assert "ok" in str(observations[2])
    env.close()
