"""Processes that die with the process that started them.

A parent killed with SIGKILL cannot stop its children, and children that
outlive it hold what a restarted parent needs: a vLLM engine's memory and
cores, a learner rank's ports. Linux's parent-death signal makes the kernel
kill them instead. The signal is tied to the thread that started the child:
the engine and the learner's ranks are started from their parent's main
thread, which lives as long as the parent does.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

#: prctl options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has
    (before the signal was armed: the process was reparented, to init or to a
    subreaper). ``expected_parent``: the parent's pid when known."""
    if not _prctl(PR_SET_PDEATHSIG, signal.SIGKILL):
        return
    parent = os.getppid()
    if parent == 1 or (expected_parent is not None and parent != expected_parent):
        os._exit(1)


def die_with_multiprocessing_parent() -> None:
    """The ``vllm.general_plugins`` entry point (it runs in every vLLM
    process): vLLM's engine core and workers are ``multiprocessing`` children
    that would otherwise go on (waiting on sockets, holding the model) after
    their actor was SIGKILLed. The actor itself, not such a child, is left
    alone."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        die_with_parent(parent.pid)


def become_subreaper() -> bool:
    """Orphaned descendants of this process are reparented to it, not to init:
    a supervisor can then find and stop what a dead child left behind, even
    processes that left the child's process group (torchrun's ranks)."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)
