"""qwenvl_vision.outputs.durable: the link-safe write every output uses."""

from __future__ import annotations

import pytest

from qwenvl_vision.errors import OutputLinkError
from qwenvl_vision.outputs.durable import replace_atomically


def test_a_killed_writer_s_temporary_file_is_replaced_and_a_link_there_left_as_it_is(tmp_path):
    """A leftover regular file at the temporary name (the same run's, killed mid-write) is written over; a link there
    is an OutputLinkError naming it, and neither it nor what it points to is touched."""
    target, tmp = tmp_path / "item", tmp_path / "item.run-r0.tmp"
    tmp.write_bytes(b"a killed writer's half")
    replace_atomically(target, tmp, lambda f: f.write(b"whole"))
    assert target.read_bytes() == b"whole" and not tmp.exists()
    victim = tmp_path / "victim"
    victim.write_bytes(b"somebody else's")
    tmp.symlink_to(victim)
    with pytest.raises(OutputLinkError, match="item.run-r0.tmp is a symbolic link"):
        replace_atomically(target, tmp, lambda f: f.write(b"new"))
    assert tmp.is_symlink() and victim.read_bytes() == b"somebody else's" and target.read_bytes() == b"whole"
