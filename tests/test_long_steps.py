"""Long steps say where they are on a terminal (`mtkc.display.Progress`) and nothing extra off it;
verify's text is a row per graph and pipeline (a row per output with -v)."""

from __future__ import annotations

import io
import sys

from mtkc.pipeline import verify as V
from mtkc.pipeline.compile import compile_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_compile_and_verify_draw_progress_on_a_terminal_only(exported, tmp_path, monkeypatch):
    model = exported("qwen2", "legacy17")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    compile_model(model, "8.0", tmp_path / "out", {"seq_len": 8, "no_convert": True})
    drawn = terminal.getvalue()
    assert "mtkc: model: pass " in drawn and "mtkc: write 2/2 files" in drawn and drawn.endswith("\r\x1b[K")
    result = V.verify(tmp_path / "out", samples=2)
    drawn = terminal.getvalue()
    assert result.ok and "mtkc: verify: original export 3/3 runs" in drawn and "mtkc: verify: compiled graphs" in drawn
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stderr", pipe)
    compile_model(model, "8.0", tmp_path / "again", {"seq_len": 8, "no_convert": True})
    V.verify(tmp_path / "again", samples=1)
    assert "\r" not in pipe.getvalue() and ": pass " not in pipe.getvalue()  # (log lines may go to a handler)
    text = V.format_text(result)
    rows = {tuple(line.split()[:2]) for line in text.splitlines()[1:3]}
    assert rows == {("model", "graph"), ("model", "partitions")} and "MISMATCH" not in text
