"""Independent meta runs in forked worker processes: ``--fit``'s changes on every core.

``--fit`` prices each change it offers with a meta run of its own (up to 13, then up to 3 pairs), one after
another, each a whole training step on meta: most of a ``--fit``'s time, on one core of many. The runs share
nothing but what the process has imported and cached, so each can run in a child forked from it (the imports,
the model's config and the shape cache's answers come with the fork, copy-on-write) and send back its figure.
The answers are the same as one after another: each child runs the same code on the same config.

A child never prints (its standard output and error go to ``/dev/null``; :func:`in_worker` is True there, for
the callers' progress lines, whose console lock a thread of the parent may hold at the fork), runs torch's CPU ops
on one thread (a parallel region of the parent's OpenMP pool hangs in a forked child: torch's own DataLoader
workers do the same), never returns
into the parent's code (it leaves through ``os._exit``: no exit handlers, no temporary directories of the
parent removed) and cannot outlive the parent: each holds the read end of a pipe whose only write end is the
parent's, and a thread in the child ends it when that pipe closes (the parent ended, SIGKILL included). The
parent kills and reaps every child it started before it returns or raises (an error, Ctrl-C).

``VRAMGUARD_WORKERS`` sets how many children run at once (1: none, every run in this process); by default the
cores this process may use, at most :data:`MAX_WORKERS`, and no more than the available memory holds of copies of
this process (a child's own pages are far fewer: each counted whole, the OOM killer is not asked).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vramguard.forking import fork

T = TypeVar("T")
R = TypeVar("R")

WORKERS = "VRAMGUARD_WORKERS"
"""The environment variable that sets how many worker processes run at once (1: none)."""

MAX_WORKERS = 8
"""The most children by default: each holds a copy of what the runs change of the parent's memory."""

_IN_WORKER = False


def in_worker() -> bool:
    """Whether this process is a worker (:func:`map_in_workers`' child): it must print nothing."""
    return _IN_WORKER


def worker_count(runs: int) -> int:
    """How many children ``runs`` independent runs take: ``VRAMGUARD_WORKERS`` or the cores this process may
    use (at most :data:`MAX_WORKERS`), never more than the runs; 1 means in this process. A bad value of the
    variable is one line (:class:`~vramguard.errors.UsageError`)."""
    from vramguard.errors import UsageError

    given = os.environ.get(WORKERS, "")
    if given:
        try:
            n = int(given)
        except ValueError:
            n = 0
        if n < 1:
            raise UsageError(f"{WORKERS} must be a whole number of processes, 1 or more; got {given!r}")
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = min(cores, MAX_WORKERS, _room())
    return max(1, min(n, runs))


def _room() -> int:
    """How many children the available memory holds, each counted as large as this whole process (a child's
    own pages are a fraction of it: what its meta run makes; the rest is shared with this process until
    written)."""
    import psutil

    here = psutil.Process().memory_info().rss
    return max(1, int(psutil.virtual_memory().available // max(here, 1)))


@dataclass(frozen=True)
class Refused:
    """A run that raised one of the ``refusals`` exception types: its type's name and its message."""

    kind: str
    message: str


class WorkerFailed(RuntimeError):
    """A worker's run raised something else than a refusal: the child's traceback is the message."""


def map_in_workers(
    run: Callable[[T], R], items: Sequence[T], refusals: tuple[type[BaseException], ...] = ()
) -> list[R | Refused]:
    """``run(item)`` of each item, in order, in :func:`worker_count` forked children at a time (or here, with
    one): each result, or :class:`Refused` where ``run`` raised one of ``refusals`` (the caller makes its own
    exception again from it). Anything else a run raises is :class:`WorkerFailed` here, after every child has
    been ended."""
    workers = worker_count(len(items))
    if workers <= 1 or not hasattr(os, "fork"):
        return [_here(run, item, refusals) for item in items]
    results: dict[int, Any] = {}
    running: dict[int, tuple[int, int, int]] = {}  # result pipe's read end: (index, pid, lifeline's write end)
    queue = list(enumerate(items))
    try:
        while queue or running:
            while queue and len(running) < workers:
                index, item = queue.pop(0)
                parents = [fd for out, (_, _, life) in running.items() for fd in (out, life)]
                try:
                    pid, out, lifeline = _start(run, item, refusals, parents)
                except OSError:  # no process to be had (memory, the process limit): this one runs here
                    results[index] = _here(run, item, refusals)
                    continue
                running[out] = (index, pid, lifeline)
            if not running:  # every item left ran here (no process to be had)
                continue
            # a child's result pipe is readable once it writes (it exits right after); only our children are
            # waited for (os.wait would reap another part's subprocess)
            ready, _, _ = select.select(list(running), [], [])
            out = ready[0]
            index, pid, lifeline = running.pop(out)
            results[index] = _collect(out, pid)
            os.close(lifeline)
            if isinstance(results[index], WorkerFailed):
                break  # no more runs: the ones still running are ended below
    finally:
        for out, (_, pid, lifeline) in running.items():
            _end(pid, out, lifeline)
    failed = [r for r in results.values() if isinstance(r, WorkerFailed)]
    if failed:
        raise failed[0]
    return [results[i] for i in range(len(items))]


def _here(run: Callable[[T], R], item: T, refusals: tuple[type[BaseException], ...]) -> R | Refused:
    try:
        return run(item)
    except refusals as exc:
        return Refused(type(exc).__name__, str(exc))


def _start(
    run: Callable[[T], R], item: T, refusals: tuple[type[BaseException], ...], lifelines: list[int]
) -> tuple[int, int, int]:
    """Fork a child that runs ``run(item)`` and writes its pickled outcome to a pipe: (pid, that pipe's read
    end, the child's lifeline's write end). ``lifelines``: the parent's ends of the other children's pipes,
    closed in the child (only the parent may hold a lifeline's write end, or a child would keep its sibling
    alive)."""
    read_out, write_out = os.pipe()
    read_life, write_life = os.pipe()
    try:
        pid = fork()
    except OSError:
        for fd in (read_out, write_out, read_life, write_life):
            os.close(fd)
        raise
    if pid:
        os.close(write_out)
        os.close(read_life)
        return pid, read_out, write_life
    _child(run, item, refusals, write_out, read_life, [read_out, write_life, *lifelines])
    raise AssertionError("unreachable")  # pragma: no cover - _child leaves through os._exit


def _child(
    run: Callable[[T], R],
    item: T,
    refusals: tuple[type[BaseException], ...],
    out: int,
    lifeline: int,
    parents: list[int],
) -> None:
    global _IN_WORKER
    code = 0
    try:
        _IN_WORKER = True
        for fd in parents:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends a child at once; the parent reports it
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")  # (a replaced sys.stdout may write to its own file)
        # a logging handler holds the parent's stderr, whose lock the parent's progress thread may have held at the
        # fork: nothing is logged here (transformers' warnings included)
        logging.disable(logging.CRITICAL)
        warnings.simplefilter("ignore")
        threading.Thread(target=_watch, args=(lifeline,), daemon=True).start()
        # one thread for torch's CPU ops (the host values of an image's pixels): OpenMP's pool is the parent's, and
        # a parallel region it began before the fork hangs a child's next one (torch's DataLoader workers do this)
        torch.set_num_threads(1)
        try:
            outcome: tuple[str, Any] = ("ok", run(item))
            data = pickle.dumps(outcome)
        except refusals as exc:
            data = pickle.dumps(("refused", Refused(type(exc).__name__, str(exc))))
        except BaseException:  # noqa: BLE001 - the parent raises it, with this traceback (a result that won't pickle too)
            data = pickle.dumps(("failed", traceback.format_exc()))
        with os.fdopen(out, "wb") as pipe:
            pipe.write(data)
    except BaseException:  # noqa: BLE001 - nothing here may return into the parent's code
        code = 1
    finally:
        os._exit(code)


def _watch(lifeline: int) -> None:
    """In a child: wait for the parent's end (its write end closes) and end this process then."""
    try:
        os.read(lifeline, 1)
    finally:
        os._exit(1)


def _collect(out: int, pid: int) -> Any:
    """A child's outcome from its pipe (read to its end, then closed) once it is readable, the child reaped; a
    child that wrote none: :class:`WorkerFailed`."""
    with os.fdopen(out, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        kind, value = pickle.loads(data)
    except Exception:  # noqa: BLE001 - nothing or a part of it written: the child ended early
        return WorkerFailed(f"a worker process ended with exit code {code} before sending its result")
    if kind == "failed":
        return WorkerFailed(f"a worker process's meta run failed:\n{value}")
    return value


def _end(pid: int, out: int, lifeline: int) -> None:
    """Kill a child still running and reap it; close its pipes."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    os.close(out)
    os.close(lifeline)


__all__ = ["MAX_WORKERS", "WORKERS", "Refused", "WorkerFailed", "in_worker", "map_in_workers", "worker_count"]
