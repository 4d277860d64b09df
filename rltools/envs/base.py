"""The environment protocol: an episode is the model's turns and what the environment answers.

The generator (`rltools.generate.episodes`) runs every sample as an episode: `reset` starts it on a
problem, whose prompt (rendered in the model's chat format) is the first observation, then the model writes a turn, which ends at end-of-sequence, at the token
budget, or at one of the environment's `stop` strings (a tool call's closing tag); `step` reads the
turn and answers with the next observation, or ends the episode. The observation's tokens are
appended to the sample and masked out of the loss: the model is trained only on what it wrote.

The episode's reward is `reward.type`'s score of its last model turn: the verifier pool scores a
step's episodes together, in parallel worker processes with a deadline per call, for every
environment alike. Single-turn math is the environment whose `step` always ends the episode.

Invariants: `step` never raises for anything the model wrote (a malformed call is a tool error,
answered like any other observation); an environment object serves one episode at a time and is
reset before each; `step` may block (a sandboxed program), so the generator calls it off the
sampling thread, and episodes of other samples keep generating meanwhile.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..data.arithmetic import Problem


@dataclass(frozen=True)
class Reply:
    observation: str | None
    """Text appended after the model's turn (not trained on); None ends the episode."""
    tool_call: bool = False
    """The turn called a tool."""
    tool_error: bool = False
    """The call failed: unparsable, unknown tool, an exception, a timeout or a sandbox limit."""


class Environment(ABC):
    stop: tuple[str, ...] = ()
    """Strings that end a model turn early, included in the turn (a tool call's closing tag)."""

    def reset(self, problem: Problem) -> None:
        """Start an episode on `problem`, whose rendered prompt (`data.prompts`) is its first observation."""

    @abstractmethod
    def step(self, turn: str) -> Reply:
        """The model's turn (its text, a stop string included) -> the next observation or the end."""

    def close(self) -> None:
        """Release what the environment holds (sandboxes); it is not used afterwards."""


class SingleTurn(Environment):
    """One completion per sample: the demo, AIME without tools."""

    def step(self, turn: str) -> Reply:
        return Reply(None)
