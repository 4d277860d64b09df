"""Stopping on Slurm's signals, so that a preempted or timed-out run loses nothing.

Slurm sends `cluster.preempt_signal` (USR2 by default) to every task of both components
`preempt_grace_s` seconds before the time limit (`#SBATCH --signal`), and an operator or a test can
send it with `scancel --signal=USR2 JOB`. scancel, `scontrol requeue`, preemption and the time limit
itself send SIGTERM, then SIGKILL after KillWait.

- Trainers: either signal sets a flag that the loop checks at safe points (between steps, and while
  waiting for rollouts); the trainers then write a checkpoint. After the warning signal, trainer rank 0
  also requeues the job (`cluster.requeue`, fewer than `cluster.max_requeues` restarts so far);
  after SIGTERM Slurm itself decides whether the job comes back.
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


class Stopped(Exception):
    """Raised where the trainer loop notices a stop request; carries the signal's name."""


class StopFlag:
    """The trainer's view of stop signals: which one arrived, if any."""

    def __init__(self, preempt_signal: str):
        self.warning = getattr(signal, f"SIG{preempt_signal}")
        self.received: str | None = None
        for signum in {self.warning, signal.SIGTERM}:
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is None:
            log.warning("received %s: stopping at the next safe point to write a checkpoint", name)
        self.received = self.received or name

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def is_warning(self) -> bool:
        """The preemption / time-limit warning, distinct from SIGTERM (which scancel sends too)."""
        return self.warning != signal.SIGTERM and self.received == signal.Signals(self.warning).name

    def check(self) -> None:
        if self.requested:
            raise Stopped(self.received)


def generator_signals(preempt_signal: str) -> None:
    """Install the generator's behaviour described in the module docstring."""
    warning = getattr(signal, f"SIG{preempt_signal}")

    def ignore(signum, frame):
        log.info("received %s: generating on until the trainers stop the job", signal.Signals(signum).name)

    def leave(signum, frame):
        log.warning("received SIGTERM: stopping")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    if warning != signal.SIGTERM:
        signal.signal(warning, ignore)
    signal.signal(signal.SIGTERM, leave)


def requeue(job_id: str) -> None:
    """Put the job (the hetjob leader: the only id Slurm can requeue) back in the queue."""
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed: {result.stderr.strip()}")
    log.warning("requeued job %s: it restarts from the checkpoint", job_id)
