"""``cli.common.interrupt_after``: a Ctrl-C inside the block comes once it ends, and never where Ctrl-C is
ignored."""

from __future__ import annotations

import os
import signal

import pytest

from hermes_gateway.handle import interrupt_after


def test_a_ctrl_c_inside_the_block_is_raised_once_the_block_has_ended() -> None:
    reached = False
    with pytest.raises(KeyboardInterrupt):
        with interrupt_after():
            os.kill(os.getpid(), signal.SIGINT)
            reached = True  # (not interrupted here)
    assert reached and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_where_ctrl_c_is_ignored_it_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with interrupt_after():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
