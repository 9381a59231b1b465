"""bench/sections.py: a bench's own section of RESULTS.md is replaced in place, and bench/run.py's
rewrite of the file carries the other benches' sections over."""

from __future__ import annotations

from bench.sections import carry_sections, replace_section

SCALING = "<!-- scaling:begin -->\n## scaling\nnew table\n<!-- scaling:end -->\n"


def test_a_section_is_replaced_where_it_stands() -> None:
    old = "# results\n\nhead\n\n<!-- scaling:begin -->\nold table\n<!-- scaling:end -->\n\n## after\ntail\n"
    assert replace_section(old, "scaling", SCALING) == (
        "# results\n\nhead\n\n<!-- scaling:begin -->\n## scaling\nnew table\n<!-- scaling:end -->\n\n## after\ntail\n"
    )


def test_a_missing_section_is_appended() -> None:
    assert replace_section("# results\n\nhead\n", "scaling", SCALING) == "# results\n\nhead\n\n" + SCALING


def test_replacing_twice_changes_nothing_more() -> None:
    once = replace_section("# results\n", "scaling", SCALING)
    assert replace_section(once, "scaling", SCALING) == once


def test_a_rewrite_keeps_the_sections_it_lacks_and_its_own() -> None:
    old = "# old host results\n\n" + SCALING + "\n<!-- other:begin -->\nx\n<!-- other:end -->\n"
    new = "# new host results\n\n<!-- other:begin -->\ny\n<!-- other:end -->\n"
    assert carry_sections(old, new) == new + "\n" + SCALING


def test_markers_of_one_section_do_not_match_another() -> None:
    old = "<!-- a:begin -->\n1\n<!-- b:end -->\n"  # not a section: its names differ
    assert carry_sections(old, "# new\n") == "# new\n"
