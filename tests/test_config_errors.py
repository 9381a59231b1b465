"""A config file's bad values are a ConfigError naming the key as the file spells it, never a
bare ValueError and never a bool taken for a number."""

from __future__ import annotations

from pathlib import Path

import pytest

from guestd.config import Config, ConfigError, load_config_file


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[limits]\nhello_timeout_s = "abc"\n', "limits.hello_timeout_s"),
        ("[limits]\nhello_timeout_s = true\n", "limits.hello_timeout_s"),
        ("[limits]\nmax_frame = 1.5\n", "limits.max_frame"),
        ('[policy]\nallowed_uids = "x"\n', "policy.allowed_uids"),
        ('[policy]\nwrite_roots = "/tmp"\n', "policy.write_roots"),
        ("[policy]\nworkload_user = 1.5\n", "policy.workload_user"),
        ('[ports]\nallow = "22"\n', "ports.allow"),
    ],
)
def test_a_bad_value_names_its_key(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "guestd.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config_file(str(path), Config())


def test_seconds_take_whole_numbers_and_fractions(tmp_path: Path) -> None:
    path = tmp_path / "guestd.toml"
    path.write_text("[limits]\nhello_timeout_s = 3\nmax_exec_timeout_s = 2.5\n")
    cfg = Config()
    load_config_file(str(path), cfg)
    assert cfg.limits.hello_timeout_s == 3.0 and isinstance(cfg.limits.hello_timeout_s, float)
    assert cfg.limits.max_exec_timeout_s == 2.5
