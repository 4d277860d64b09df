"""Stopping on Slurm's signals, so that a preempted or timed-out run loses nothing.

Slurm sends `cluster.preempt_signal` (USR2 by default) to every task of both components
`preempt_grace_s` seconds before the time limit (`#SBATCH --signal`), and an operator or a test can
send it with `scancel --signal=USR2 JOB`. scancel, `scontrol requeue`, preemption and the time limit
itself send SIGTERM, then SIGKILL after KillWait.

- Trainers: SIGTERM before the first step ends the process at once (there is nothing to save).
  Otherwise either signal sets a flag that the loop checks at safe points (between steps, and while
  waiting for rollouts); the trainers then write a checkpoint. After the warning signal, trainer rank 0
  also requeues the job (`cluster.requeue`, fewer than `cluster.max_requeues` restarts so far);
  after SIGTERM Slurm itself decides whether the job comes back.
- From its first instant (`catch_early`, before any slow import) a role process keeps a signal
  rather than dying of it: a trainer records it and stops at its first safe point (a warning during
  start-up still requeues the job), a generator ignores the warning and leaves on SIGTERM.
- Generators ignore the warning: the trainers decide when the job stops, and a generator that exited
  would make the job script stop the trainers in the middle of their checkpoint. On SIGTERM they
  exit at once, successfully: shards are written atomically, so nothing is lost.
"""

import logging
import os
import signal
import subprocess
import sys

log = logging.getLogger("rltools.preempt")

EXIT_STOPPED = 3
"""Exit code of a trainer that stopped at a checkpoint on a signal: the run is resumable."""


CANDIDATES = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
"""Signals cluster.preempt_signal may name besides SIGTERM (SIGINT keeps Python's KeyboardInterrupt)."""
_early: list[str] = []  # names of signals received before the role read its config


def catch_early(role: str) -> None:
    """The first thing a role process does: until the role knows its config (and so which signal is
    the warning), keep every candidate signal instead of dying of it. A generator may leave on
    SIGTERM at once: nothing it holds yet needs saving."""

    def keep(signum, frame) -> None:
        _early.append(signal.Signals(signum).name)

    for signum in CANDIDATES:
        signal.signal(signum, keep)
    signal.signal(signal.SIGTERM, keep if role == "trainer" else lambda signum, frame: os._exit(0))


class Stopped(Exception):
    """Raised where the trainer loop notices a stop request; carries the signal's name."""


class StopFlag:
    """The trainer's view of stop signals: which one arrived, if any."""

    def __init__(self, preempt_signal: str):
        self.warning = getattr(signal, f"SIG{preempt_signal}")
        self.received: str | None = None
        self._requeue = False
        self.starting = True
        """Until the first step: SIGTERM then ends the process at once (nothing to checkpoint, and a
        trainer waiting for generators that will never join must not hold up the shutdown)."""
        stops = {signal.Signals(self.warning).name, "SIGTERM"}
        for name in _early:  # received during start-up: stop at the first safe point
            if name in stops:
                self._handle(getattr(signal, name), None)
            else:
                log.info("ignored %s received during start-up (not cluster.preempt_signal)", name)
        for signum in {self.warning, signal.SIGTERM}:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and self.starting:
            log.warning("received SIGTERM while starting: nothing to checkpoint yet; stopping")
            logging.shutdown()
            os._exit(EXIT_STOPPED)
        if self.received is None:
            log.warning("received %s: stopping at the next safe point to write a checkpoint", name)
        self.received = self.received or name

    def request(self, reason: str, requeue: bool) -> None:
        """A stop the trainer itself decides (too few generator engines left): handled as a signal,
        requeued as after the warning when `requeue`."""
        if self.received is None:
            log.warning("stopping at the next safe point to write a checkpoint: %s", reason)
            self.received, self._requeue = reason, requeue

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def is_warning(self) -> bool:
        """The preemption / time-limit warning, distinct from SIGTERM (which scancel sends too)."""
        if self._requeue:
            return True
        return self.warning != signal.SIGTERM and self.received == signal.Signals(self.warning).name

    def check(self) -> None:
        if self.requested:
            raise Stopped(self.received)


_before_leaving: list = []


def before_leaving(callback) -> None:
    """In a generator: run `callback()` when SIGTERM ends the process (tell the trainer it leaves)."""
    _before_leaving.append(callback)


def generator_signals(preempt_signal: str) -> None:
    """Install the generator's behaviour described in the module docstring."""
    warning = getattr(signal, f"SIG{preempt_signal}")

    def ignore(signum, frame):
        log.info("received %s: generating on until the trainers stop the job", signal.Signals(signum).name)

    def leave(signum, frame):
        log.warning("received SIGTERM: stopping")
        for callback in _before_leaving:
            callback()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    for name in _early:  # SIGTERM during start-up has ended the process already
        log.info("ignored %s received during start-up: the trainers decide when the job stops", name)
    if warning != signal.SIGTERM:
        signal.signal(warning, ignore)
    signal.signal(signal.SIGTERM, leave)


def requeue(job_id: str) -> None:
    """Put the job (the hetjob leader: the only id Slurm can requeue) back in the queue.

    The requeue sends SIGTERM to every task of the job, this one included, possibly before
    `scontrol` returns: it is ignored meanwhile, so the process gets to say what it did (the
    checkpoint is written; it exits right after)."""
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}")
        log.warning("requeued job %s: it restarts from the checkpoint", job_id)
    finally:
        signal.signal(signal.SIGTERM, previous)
