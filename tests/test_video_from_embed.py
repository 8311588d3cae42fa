"""A video test that lived among the embed tests (to merge into tests/test_video.py)."""

from __future__ import annotations

import pytest

from qwenvl_vision.encoder import load_encoder
from tests.helpers import write_video


def test_a_header_without_frame_count_is_counted_once_per_video(tmp_path, checkpoint, monkeypatch):
    """Matroska writes no frame count: the decode estimate's probe counts the packets, and the read reuses it."""
    pytest.importorskip("av")
    import qwenvl_vision.video as video

    write_video(tmp_path / "clip.mkv", 20, 48, 40, 10)
    counts = []
    real = video._count_packets
    monkeypatch.setattr(video, "_count_packets", lambda *a: counts.append(1) or real(*a))
    encoder = load_encoder(checkpoint, device="cpu")
    [[result]] = list(encoder.iter_encode([str(tmp_path / "clip.mkv")], video=None))
    assert result.ok and result.video_info.total_frames == 20
    assert len(counts) == 1
