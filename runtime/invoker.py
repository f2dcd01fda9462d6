"""Makes IREE CPU calls from a thread that yields to IREE's workers.

On the ``local-task`` driver the thread that calls a module records and submits its work, then waits for the
task system's workers and spins in that wait (0.3-0.6 ms of CPU a call on a gpt-oss-20b layer, whatever the
token count; docs/cpu.md). Where the workers have no spare core (one worker per core, or a busy host) the
scheduler shares a core between the spinning caller and a worker, and the worker can lose its core for
milliseconds. Made from a thread of lower priority (a higher nice value), the same calls leave the workers their
cores: on the 2-vCPU host of docs/cpu.md, 2 workers, a gpt-oss-20b layer at 4 tokens went from p75 / p90 8.2 /
10.8 ms to 6.7 / 7.3 (fastest calls the same). Only the calling thread's priority changes: the workers are made
by the IREE device and keep the priority of the thread that made it.

``MXMOE_CALL_NICE`` sets how much higher the calling thread's nice value is (default 10; 0 calls on the caller's
own thread). Unprivileged processes may raise a thread's nice value but not lower it again, which is why the
calls go to a thread of their own rather than lowering the caller's.
"""

from __future__ import annotations

import os
import queue
import sys
import threading

DEFAULT_NICE = 10
ENV_NICE = "MXMOE_CALL_NICE"

_SHARED: dict[str, "Invoker"] = {}
_SHARED_LOCK = threading.Lock()


def call_nice() -> int:
    """The nice increment of the calling thread from ``MXMOE_CALL_NICE`` (0-19; a bad value is an error)."""
    raw = os.environ.get(ENV_NICE, "").strip()
    if not raw:
        return DEFAULT_NICE
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{ENV_NICE}={raw!r}: expected an integer 0-19") from None
    if not 0 <= value <= 19:
        raise ValueError(f"{ENV_NICE}={raw!r}: expected an integer 0-19")
    return value


class Invoker:
    """One daemon thread, ``nice`` levels below the thread that makes it, that runs the functions given to it one
    at a time and hands back their results (or raises their exceptions) in the calling thread."""

    def __init__(self, nice: int):
        self.nice = nice
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = os.getpid()
        self._ident: int | None = None
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), name="mxmoe-iree-calls", daemon=True).start()
        ready.wait()

    def _serve(self, ready: threading.Event) -> None:
        self._ident = threading.get_ident()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.nice)
        except OSError:
            pass  # a platform or sandbox that refuses it: the calls still run, at the caller's priority
        ready.set()
        while True:
            fn, args, reply = self._requests.get()
            try:
                reply.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                reply.put((False, exc))
            del fn, args, reply  # hold nothing of a call (inputs, buffers) until the next one

    def __call__(self, fn, *args):
        # a call made from inside a call, or in a forked child (where the thread does not exist): run it here
        if threading.get_ident() == self._ident or os.getpid() != self._pid:
            return fn(*args)
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put((fn, args, reply))
        ok, value = reply.get()
        if not ok:
            raise value
        return value


def invoker_for(driver: str) -> "Invoker | None":
    """The process's invoker for ``driver``'s calls: one for ``local-task`` unless ``MXMOE_CALL_NICE=0``, None for
    the other drivers (``local-sync`` computes on the calling thread itself, a GPU driver's wait is not on CPU
    workers) and off Linux (where a nice value is per process, not per thread). A forked child gets an invoker of
    its own (threads do not survive a fork)."""
    if driver != "local-task" or not sys.platform.startswith("linux"):
        return None
    nice = call_nice()
    with _SHARED_LOCK:
        inv = _SHARED.get(driver)
        if nice == 0:
            return None
        if inv is None or inv._pid != os.getpid() or inv.nice != nice:
            inv = _SHARED[driver] = Invoker(nice)
        return inv
