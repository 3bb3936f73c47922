"""Ctrl-C at any point leaves the runtime consistent: KeyboardInterrupt is deferred out of critical sections.

Python raises KeyboardInterrupt in the main thread between any two bytecodes. Landing between a vkQueueSubmit and
the bookkeeping that tracks it, it left a command buffer in flight that the runtime later reset and submitted again
(wrong results, then a segfault). Functions that change the runtime's books are marked `critical`; waits, where an
interrupt is safe and wanted, are marked `interruptible`. A SIGINT handler, installed on the main thread while
Python's default handler is in place, looks at the interrupted stack: if the innermost marked frame is critical it
asks again two milliseconds later instead of raising; otherwise it raises KeyboardInterrupt as Python would. The hot
path pays nothing: the marks are sets of code objects, read only when a signal arrives.

Another handler installed later (by the user, asyncio, a server) replaces this one; then interrupts are not
deferred. Python's asyncio.run installs its own handler only while the default one is in place.
"""

from __future__ import annotations

import _thread
import _weakrefset
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TypeVar

F = TypeVar("F", bound=Callable)
_CRITICAL: set = set()
_INTERRUPTIBLE: set = set()
# weakref callbacks and finalizers run inside the garbage collector, which prints and drops what they raise: an
# interrupt landing there would be lost, and the books they keep left half-changed
_CALLBACK_FILES = frozenset({weakref.__file__, _weakrefset.__file__})
RETRY_S = 0.002


def critical(fn: F) -> F:
    """Mark fn: a KeyboardInterrupt arriving while it runs (and no interruptible call inside it) waits for it."""
    _CRITICAL.add(fn.__code__)
    return fn


def interruptible(fn: F) -> F:
    """Mark fn as a safe point for KeyboardInterrupt even when called from a critical function."""
    _INTERRUPTIBLE.add(fn.__code__)
    return fn


def in_critical(frame: FrameType | None) -> bool:
    """Whether the innermost marked frame of this stack is critical."""
    while frame is not None:
        code = frame.f_code
        if code in _INTERRUPTIBLE:
            return False
        if code in _CRITICAL or code.co_filename in _CALLBACK_FILES:
            return True
        frame = frame.f_back
    return False


def _handler(signum: int, frame: FrameType | None) -> None:
    if in_critical(frame):
        retry = threading.Timer(RETRY_S, _thread.interrupt_main, (signum,))
        retry.daemon = True
        retry.start()
        return
    signal.default_int_handler(signum, frame)


def install() -> bool:
    """Install the deferring SIGINT handler if called on the main thread while Python's default one is in place;
    returns whether it is installed."""
    if threading.current_thread() is not threading.main_thread():
        return signal.getsignal(signal.SIGINT) is _handler
    current = signal.getsignal(signal.SIGINT)
    if current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _handler)
        return True
    return current is _handler
