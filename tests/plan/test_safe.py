"""The run-folder primitives: nothing follows a link, nothing non-regular is opened, every value printed is one line."""

import os

import pytest

from seqpar.plan.errors import SeqparError
from seqpar.plan.safe import append_text, inside, links_in, printable, read_bytes, refuse_links


@pytest.mark.parametrize(
    "raw",
    ["a\nb", "a\rb", "x\x1b[2Jy", "\u2028", "\u202e evil", "tab\there", "\x7f", "\x85", "\ud800"],
)
def test_printable_leaves_no_control_character(raw):
    out = printable(raw)
    assert "\n" not in out and "\r" not in out and "\x1b" not in out
    assert all(ch.isprintable() for ch in out), out
    assert out != raw


def test_printable_is_identity_on_plain_text_and_distinguishes_an_escaped_backslash():
    assert printable("constant 2e-05, no warmup") == "constant 2e-05, no warmup"
    assert printable("a\\nb") != printable("a\nb")


def test_printable_cuts_long_values():
    assert printable("x" * 1000, limit=10) == "x" * 10 + "... (990 more characters)"


def test_append_and_read_refuse_a_symbolic_link(tmp_path):
    target = tmp_path / "victim.pth"
    target.write_text("")
    link = tmp_path / "train.log"
    link.symlink_to("victim.pth")
    with pytest.raises(SeqparError, match="symbolic link"):
        append_text(link, "import os\n")
    assert target.read_text() == ""
    with pytest.raises(SeqparError, match="symbolic link"):
        read_bytes(link)


def test_append_creates_and_appends(tmp_path):
    p = tmp_path / "metrics.jsonl"
    append_text(p, "a\n")
    append_text(p, "b\n")
    assert p.read_text() == "a\nb\n"
    refuse_links(tmp_path)  # a folder without links passes


def test_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(SeqparError, match="a FIFO, not a regular file"):
        read_bytes(fifo)


def test_read_limit(tmp_path):
    p = tmp_path / "trainer_state.json"
    p.write_bytes(b"x" * 100)
    assert read_bytes(p, limit=100) == b"x" * 100
    with pytest.raises(SeqparError, match="holds 100 bytes"):
        read_bytes(p, limit=99)


def test_links_in_finds_nested_links_and_refuse_names_the_first(tmp_path):
    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").symlink_to("/etc")
    (tmp_path / "checkpoints" / "step-2" / "x").symlink_to("/etc/passwd")
    assert [p.name for p in links_in(tmp_path)] == ["latest", "x"]
    with pytest.raises(SeqparError, match=r"latest'.*\(and 1 more\)"):
        refuse_links(tmp_path)


def test_inside(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert inside(tmp_path, "checkpoints/step-4")
    assert not inside(tmp_path, "../elsewhere")
    assert not inside(tmp_path, "/etc")
