"""Constrained string types for config fields.

Every config value that reaches a rendered sbatch script is either one of these validated types
(it lands on an `#SBATCH` line, which Slurm parses itself, so it must be a single safe word) or is
shell-quoted by the renderer. Nothing else gets into the script.
"""

import os
import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, values are frozen, each field's docstring is its doc."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def expand_env(value: str) -> str:
    """Expand `${VAR}` and `${VAR:-default}` references, and a leading `~`."""

    def substitute(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ValueError(
            f"environment variable {name} is not set; export it, or write ${{{name}:-DEFAULT}}"
        )

    return os.path.expanduser(_ENV_REF.sub(substitute, value))


def _matching(pattern: str, what: str):
    compiled = re.compile(pattern)

    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(f"must be {what}")
        return value

    return AfterValidator(check)


def _single_line(value: str) -> str:
    if "\n" in value or "\r" in value:
        raise ValueError("must be a single line")
    return value


EnvPath = Annotated[str, AfterValidator(expand_env)]
"""A filesystem path; `${VAR}` / `${VAR:-default}` and `~` are expanded when the config loads."""

RunName = Annotated[
    str, _matching(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", "1-64 characters from [A-Za-z0-9._-], not starting with . or -")
]
SlurmWord = Annotated[
    str, _matching(r"[A-Za-z0-9][A-Za-z0-9._,+-]*", "a Slurm name from [A-Za-z0-9._,+-] (no spaces or quotes)")
]
SlurmTime = Annotated[
    str,
    _matching(
        r"(\d+-)?\d+(:\d{1,2}){0,2}",
        "a Slurm time limit like 30, 04:00:00 or 2-00:00:00 (minutes, H:M:S or D-H:M:S)",
    ),
]
SlurmMem = Annotated[str, _matching(r"\d+[KMGT]?", "a Slurm memory size like 64G or 500000M (0 = all)")]
EnvName = Annotated[str, _matching(r"[A-Za-z_][A-Za-z0-9_]*", "a shell variable name like HF_HOME")]
SbatchOption = Annotated[str, _matching(r"[a-z][a-z0-9-]*", "an sbatch long option name like constraint")]
SbatchValue = Annotated[
    str,
    _matching(
        r"[A-Za-z0-9_.,:=@%+/&|*\[\]!-]*",
        "an sbatch option value without spaces, quotes, backslashes or shell characters",
    ),
]
ShellLine = Annotated[str, AfterValidator(_single_line)]
ContainerMount = Annotated[
    str,
    AfterValidator(expand_env),
    _matching(  # both container runtimes split a mount list at commas and a mount at colons
        r"/[^\s,:'\"\\]*:/[^\s,:'\"\\]*(:ro|:rw)?",
        "SRC:DST or SRC:DST:ro, absolute paths without spaces, quotes, backslashes, commas or colons, "
        "e.g. /scratch/data:/data:ro",
    ),
]
"""A container bind mount; `${VAR}` and `~` are expanded first, like EnvPath."""
