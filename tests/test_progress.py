"""The progress line: drawn only on a terminal, erased at the end, ETA from the rate so far."""

import io

from mtkc.display import Progress


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_silent_off_a_terminal():
    stream = io.StringIO()
    with Progress("verify", total=3, stream=stream) as p:
        p.advance(3)
    assert stream.getvalue() == ""


def test_progress_draws_and_erases_on_a_terminal():
    stream = _Tty()
    now = [0.0]
    p = Progress("calibrate", total=4, unit="prompt", stream=stream, interval=0, clock=lambda: now[0])
    now[0] = 10.0
    p.advance()  # 1 prompt in 10 s: 3 left at 0.1/s -> 30 s
    assert stream.getvalue() == "\r\x1b[Kmtkc: calibrate 1/4 prompts, 0.10/s, ETA 30s, 10s"
    now[0] = 100.0
    p.advance(3)
    assert stream.getvalue().endswith("mtkc: calibrate 4/4 prompts, 0.04/s, 1:40")
    p.close()
    assert stream.getvalue().endswith("\r\x1b[K")
