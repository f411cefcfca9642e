"""``XGrammarWorkers``: xgrammar compilations in worker processes that can be killed.

    workers = shared_workers(info, processes=2, memory_mb=2048)   # info: the xgr.TokenizerInfo matchers use
    text = workers.compile_text(constraint, seconds=60)   # the CompiledGrammar's JSON; LimitError past a limit

xgrammar cannot cancel a compilation: its C++ runs to the end holding what memory it took
(a 500-branch ``anyOf`` on a 32,000-token vocabulary: 15 s and 2.6 GB). So each one runs in a
worker process: forked from multiprocessing's fork server (a single-threaded process that
imported xgrammar once: a worker starts in milliseconds, and copies no lock another thread
of the caller held), built with the caller's vocabulary, sent each constraint, answering
with the grammar serialized (``CompiledGrammar.serialize_json``; Tekken's 131k tokens: ~0.1 s
both ways for a small schema). Bounds:

* time: past ``seconds`` from when it was sent, the worker is killed and the caller gets
  ``LimitError("compile_seconds")``; the worker's own CPU limit (RLIMIT_CPU, the deadline plus
  a margin) stops it even if the caller died;
* memory: its address space is capped at its size after start-up plus ``memory_mb``
  (RLIMIT_AS): an allocation past it fails, ``LimitError("compile_memory_mb")``;
* CPU share: it runs at nice 10 (a tenth of a normal process's weight), so a serving
  process's own threads come first.

A caller that is itself a daemonic process (every ``multiprocessing.Pool`` worker is one) may not start
multiprocessing children: there a worker is a plain subprocess (``_Child``: the same loop, caps and nice
level, over two pipes), so the limits hold wherever the library runs.

At most ``processes`` compile at once (later callers wait their turn, which their deadline
does not count); idle workers are reused, a killed one replaced on demand. Engines on one
vocabulary share one set of workers (``shared_workers``: the last :data:`SHARED` vocabularies'
are kept; an older set's idle workers stop, and it serves the engines that hold it on), so a
runtime made per call does not start processes per call. Workers leave when their set is closed or the caller exits (their pipe closes).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import resource
import signal
import subprocess
import sys
import threading
import weakref

from neuron_constrain.structured.constraints import Constraint, ConstraintError
from neuron_constrain.structured.schema.limits import LimitError

_START_SECONDS = 120  # the longest a subprocess worker (_Child) may take to import and build its compiler
_CPU_MARGIN = 5  # seconds of CPU a job may use past its deadline before its worker stops itself
SHARED = 4  # vocabularies whose workers are kept
NICE = 10  # a worker's CPU weight is a tenth of a normal process's: serving comes first, compiles still move
_CONTEXT = None
_REGISTRY: "collections.OrderedDict[tuple, XGrammarWorkers]" = collections.OrderedDict()
_REGISTRY_LOCK = threading.Lock()


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload([__name__])  # xgrammar and the library, imported once for every worker
    return _CONTEXT


_STARTING = threading.Lock()


@contextlib.contextmanager
def _main_module_hidden():
    """While a worker starts, the caller's ``__main__`` has no name or file: multiprocessing would
    otherwise run it again in the worker (vLLM's API server module, a script's top level)."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__spec__", "__file__") if name in main.__dict__}
    with _STARTING:
        main.__spec__ = None
        main.__dict__.pop("__file__", None)
        try:
            yield
        finally:
            main.__dict__.update(saved)


class _Worker:
    __slots__ = ("process", "conn")

    def __init__(self, info_json: str, memory_mb: int):
        if multiprocessing.current_process().daemon:  # a Pool worker, say: multiprocessing refuses it children
            self.process, self.conn = _Child.start(info_json, memory_mb)
            return
        context = _context()
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, info_json, memory_mb), daemon=True,
                                       name="xgrammar-compile")
        with _main_module_hidden():
            self.process.start()
        child.close()

    def stop(self, kill: bool) -> None:
        if kill and self.process.is_alive():
            self.process.kill()
        self.conn.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


class _Pipes:
    """One end of two one-way pipes, as the duplex connection ``_serve`` and ``XGrammarWorkers._run`` use."""

    def __init__(self, read_fd: int, write_fd: int):
        self._in = multiprocessing.connection.Connection(read_fd, writable=False)
        self._out = multiprocessing.connection.Connection(write_fd, readable=False)
        self.recv, self.poll, self.send = self._in.recv, self._in.poll, self._out.send

    def close(self) -> None:
        self._in.close()
        self._out.close()


class _Child:
    """A worker started as a plain subprocess (``python -c``: :func:`_serve_subprocess`), for a caller that is itself
    a daemonic process (a ``multiprocessing.Pool`` worker), which multiprocessing refuses children: the same
    ``_serve``, caps and nice level; the ``Process`` methods ``_Worker`` uses."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    @classmethod
    def start(cls, info_json: str, memory_mb: int) -> tuple["_Child", _Pipes]:
        from_parent, to_child = os.pipe()  # (read end, write end)
        from_child, to_parent = os.pipe()
        code = f"from {__name__} import _serve_subprocess; _serve_subprocess({from_parent}, {to_parent})"
        popen = subprocess.Popen([sys.executable, "-c", code], pass_fds=(from_parent, to_parent),
                                 stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        conn = _Pipes(from_child, to_child)
        conn.send((info_json, memory_mb))
        if not conn.poll(_START_SECONDS) or conn.recv() != "ready":  # its imports and compiler: not a job's time
            popen.kill()
            raise RuntimeError(f"xgrammar's compile worker (a subprocess) did not start in {_START_SECONDS} s")
        return cls(popen), conn

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


def shared_workers(info, *, processes: int, memory_mb: int) -> "XGrammarWorkers":
    """The workers for ``info`` (an ``xgr.TokenizerInfo``) and ``memory_mb``, made on first use; at
    least ``processes`` of them may compile at once."""
    key = (id(info), memory_mb)
    with _REGISTRY_LOCK:
        workers = _REGISTRY.get(key)
        if workers is None or workers.closed:
            workers = _REGISTRY[key] = XGrammarWorkers(info, processes=processes, memory_mb=memory_mb)
            while len(_REGISTRY) > SHARED:  # forgotten: its idle workers stop, its engines keep using it
                _REGISTRY.popitem(last=False)[1].stop_idle()
        _REGISTRY.move_to_end(key)
        workers.processes = max(workers.processes, processes)
        return workers


class XGrammarWorkers:
    """Worker processes compiling xgrammar grammars for one vocabulary (see the module docstring)."""

    def __init__(self, info, *, processes: int, memory_mb: int):
        self.info, self.memory_mb = info, memory_mb  # the info is kept: the registry's key is its id
        self.processes = processes
        self._info_json: str | None = None
        self._busy = 0
        self._turn = threading.Condition()
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._live: set[_Worker] = set()
        self.killed = 0  # workers stopped past a limit (killed at a deadline, dead, out of memory)
        self.closed = False
        self._warmed = threading.Event()
        weakref.finalize(self, _stop_all, self._live)
        # the fork server's start imports xgrammar and the library (seconds): begun now, off the caller's path
        threading.Thread(target=self._warm, daemon=True, name="xgrammar-compile-warm").start()

    def _warm(self) -> None:
        try:
            worker = self._take()
        except Exception:  # noqa: BLE001 - a compile that needs a worker starts one and reports why not
            return
        finally:
            self._warmed.set()
        self._give_back(worker)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until the first worker has started (the fork server's imports): a compilation's time
        limit counts from when a worker can take it."""
        self._warmed.wait(timeout)

    def compile_text(self, constraint: Constraint, seconds: float) -> str:
        """``constraint`` (already through the engine's keyword policy) compiled in a worker: the grammar as the
        worker sent it (``CompiledGrammar.serialize_json``; the caller deserializes it, and the disk cache
        stores it as it is)."""
        job = dataclasses.replace(constraint, validate=None)  # a tool's validator is the caller's, not xgrammar's
        with self._turn:
            self._turn.wait_for(lambda: self._busy < self.processes)
            self._busy += 1
        try:
            status, payload = self._run(job, seconds)
        finally:
            with self._turn:
                self._busy -= 1
                self._turn.notify()
        if status == "ok":
            return payload
        if status == "memory":
            raise LimitError("compile_memory_mb", f"xgrammar ran out of its {self.memory_mb} MiB ({payload})",
                             self.memory_mb)
        raise ConstraintError(payload)

    def _run(self, job: Constraint, seconds: float) -> tuple[str, str]:
        """One job on an idle worker (or a new one): its reply, or LimitError past the deadline."""
        worker = self._take()
        try:
            worker.conn.send((job, seconds))
            if not worker.conn.poll(seconds):
                raise LimitError("compile_seconds", f"still compiling after {seconds:g} s", seconds)
            status, payload = worker.conn.recv()
        except (EOFError, OSError):
            self._discard(worker)
            raise self._died(worker, seconds) from None
        except BaseException:  # past the deadline (LimitError), or the caller interrupted: the worker goes
            self._discard(worker)
            raise
        if status == "memory":  # xgrammar's state after a failed allocation is not trusted: a fresh worker
            self._discard(worker)
        else:
            self._give_back(worker)
        return status, payload

    def _died(self, worker: _Worker, seconds: float) -> ConstraintError:
        worker.process.join(timeout=5)
        code = worker.process.exitcode
        if code == -signal.SIGXCPU:
            return LimitError("compile_seconds", f"its worker used its CPU limit ({seconds:g} s)", seconds)
        if code in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP):  # stopped from outside, not by a limit
            return ConstraintError(f"the compile worker was stopped by signal {-code} before it answered (the "
                                   f"process is shutting down, or another process stopped it); send it again")
        return LimitError("compile_memory_mb", f"the compile worker died (exit {code}), most likely past its "
                          f"{self.memory_mb} MiB", self.memory_mb)

    def _take(self) -> _Worker:
        with self._lock:
            if self.closed:
                raise RuntimeError("the engine's compile workers were closed; make a new engine")
            if self._idle:
                return self._idle.pop()
            if self._info_json is None:
                self._info_json = self.info.serialize_json()
        worker = _Worker(self._info_json, self.memory_mb)
        with self._lock:
            self._live.add(worker)
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if not self.closed:
                self._idle.append(worker)
                return
        self._discard(worker)

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        self.killed += 1
        worker.stop(kill=True)

    def pids(self) -> list[int]:
        """The live workers' process ids."""
        with self._lock:
            return [w.process.pid for w in self._live if w.process.is_alive()]

    def stop_idle(self) -> None:
        """Stop the workers not compiling now (a later compilation starts one again)."""
        with self._lock:
            idle, self._idle = self._idle, []
            self._live.difference_update(idle)
        for worker in idle:
            worker.stop(kill=False)

    def close(self) -> None:
        with self._lock:
            self.closed = True
        self.stop_idle()


def _stop_all(live: set) -> None:
    for worker in list(live):
        worker.stop(kill=True)


# --------------------------------------------------------------------------- in the worker
def _serve(conn, info_json: str, memory_mb: int, ready: bool = False) -> None:
    """A worker's life: build the compiler, cap the address space (``ready``: then say so), compile each job
    until the pipe closes."""
    import xgrammar as xgr

    from neuron_constrain.structured.engines.xgrammar.grammars import compile_grammar

    os.nice(NICE)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1)
    del info_json
    _cap_address_space(memory_mb)
    if ready:
        conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        constraint, seconds = job
        _cap_cpu(seconds)
        try:
            reply = ("ok", compile_grammar(compiler, constraint).serialize_json())
        except BaseException as error:  # noqa: BLE001 - every failure goes back to the caller
            reply = ("memory", _short(error)) if _out_of_memory(error) else ("error", _short(error))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError, MemoryError):
            return


def _serve_subprocess(read_fd: int, write_fd: int) -> None:
    """``_Child``'s worker: its pipes from the command line, its vocabulary and cap as the first message;
    its standard output goes to standard error (nothing may write into a pipe but the replies)."""
    conn = _Pipes(read_fd, write_fd)
    os.dup2(2, 1)
    info_json, memory_mb = conn.recv()
    _serve(conn, info_json, memory_mb, ready=True)


def _cap_address_space(memory_mb: int) -> None:
    with open("/proc/self/statm") as statm:
        size = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + (memory_mb << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def _cap_cpu(seconds: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    limit = int(used + seconds + _CPU_MARGIN) + 1
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))


def _out_of_memory(error: BaseException) -> bool:
    while error is not None:
        if isinstance(error, MemoryError) or "bad_alloc" in str(error) or "Cannot allocate memory" in str(error):
            return True
        error = error.__cause__
    return False


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:500] or type(error).__name__
