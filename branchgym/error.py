"""The flat family of errors branchgym raises.

Every message says what to do about it. All errors derive from :class:`Error`, so
``except branchgym.error.Error`` catches anything this package raises on purpose.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Error",
    "UnknownEnvError",
    "RegistrationError",
    "SnapshotError",
    "SnapshotNotSupportedError",
    "SnapshotReleasedError",
    "SnapshotMismatchError",
    "SnapshotCorruptError",
    "SnapshotUntrustedError",
    "SnapshotNotPicklableError",
    "UnsnapshottableWrapperError",
    "WrapperStateError",
    "ResetNeededError",
    "InvalidActionError",
    "DataError",
    "GameLoadError",
    "ModelNotCachedError",
    "TreeFormatError",
    "FidelityViolation",
    "FidelitySetupError",
    "FidelityWarning",
    "DependencyMissingError",
    "LossInputError",
    "SandboxError",
    "OptionError",
    "SandboxConfigError",
    "SandboxUnavailableError",
    "RepoEnvironmentError",
    "ScheduleError",
    "ExecutorError",
    "EngineError",
    "TrainingConfigError",
    "IntegrationError",
    "CheckpointError",
    "RemoteError",
    "RemoteAuthError",
    "ForeignSnapshotError",
    "EndpointError",
    "EndpointAuthError",
]


class Error(Exception):
    """Base class of every error raised by branchgym."""


class UnknownEnvError(Error, KeyError):
    """An environment id is not registered."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class RegistrationError(Error, ValueError):
    """A registration call is malformed (bad id, bad snapshot declaration)."""


class SnapshotError(Error):
    """Base class of snapshot and restore failures."""


class SnapshotNotSupportedError(SnapshotError, NotImplementedError):
    """The environment (or a layer of its wrapper stack) cannot take snapshots."""


class SnapshotReleasedError(SnapshotError):
    """A snapshot was used after :meth:`Snapshot.release`."""


class SnapshotMismatchError(SnapshotError, ValueError):
    """A snapshot was restored into an environment built from another spec or wrapper stack."""


class SnapshotCorruptError(SnapshotError, ValueError):
    """A snapshot's bytes or payload are damaged and cannot be restored."""


class SnapshotUntrustedError(SnapshotCorruptError):
    """Snapshot bytes reference a type that is not allowed, or carry another key's signature."""


class SnapshotNotPicklableError(SnapshotError, TypeError):
    """A snapshot that owns live resources was pickled."""


class UnsnapshottableWrapperError(SnapshotError):
    """A wrapper in the stack holds state branchgym does not know how to capture."""


class WrapperStateError(UnsnapshottableWrapperError):
    """A wrapper lacks an attribute its declared state names.

    The built-in table names private attributes of the Gymnasium wrappers of the versions
    pyproject allows; another version may have renamed them.
    """


class ResetNeededError(Error, RuntimeError):
    """``step``/``snapshot`` was called before ``reset``."""


class InvalidActionError(Error, ValueError):
    """An action is not an element of the action space (non-text environments)."""


class DataError(Error, ValueError):
    """A data file is missing, unreadable or malformed."""


class GameLoadError(DataError):
    """A game (e.g. an ALFWorld PDDL problem) cannot be loaded by its engine."""


class ModelNotCachedError(DataError):
    """A Hugging Face Hub model id is not in the local Hub cache (nothing is downloaded)."""


class TreeFormatError(DataError):
    """A rollout tree file is unreadable, malformed, or of a format version this release lacks."""


class FidelityViolation(SnapshotError, AssertionError):
    """A restored state behaves differently from the state that was snapshotted.

    Attributes:
        violation: The structured record (``branchgym.fidelity.violation.Violation``): the
            check that caught it, the first diverging step, the field and both values.
    """

    def __init__(self, message: str = "", violation: Any = None) -> None:
        super().__init__(message)
        self.violation = violation


class FidelitySetupError(Error, ValueError):
    """A fidelity check is configured wrongly (unknown mode, no way to build a twin)."""


class FidelityWarning(UserWarning):
    """Warning category of ``FidelityCheck(on_violation="warn")``; filter it like any warning."""


class DependencyMissingError(Error, ImportError):
    """An optional dependency (an extra) is needed for this feature."""

    @classmethod
    def for_extra(cls, what: str, extra: str, module: str) -> DependencyMissingError:
        """Build the standard message naming the pip extra that provides ``module``."""
        return cls(
            f"{what} needs the optional dependency {module!r}. "
            f"Install it with: pip install 'branchgym[{extra}]'"
        )


class LossInputError(Error, ValueError):
    """Inputs to an advantage or loss function are malformed (shape, value or option)."""


class SandboxError(Error, RuntimeError):
    """A sandbox operation failed (a path outside the repository, a closed sandbox)."""


class SandboxConfigError(SandboxError, ValueError):
    """A sandbox option is invalid (a resource limit that is not a size, an unknown limit)."""


class SandboxUnavailableError(SandboxError):
    """A sandbox backend cannot run on this machine (no mounts, no Docker daemon, no image)."""


class RepoEnvironmentError(SandboxUnavailableError):
    """A task's own Python environment cannot be built (install failed, dependencies missing)."""


class CacheLocationError(SandboxConfigError):
    """The branchgym cache cannot be used where it is (not writable, a name PATH cannot hold).

    The message names the folder and says what to set ``BRANCHGYM_CACHE`` to.
    """


class SandboxSetupError(SandboxUnavailableError):
    """A sandbox cannot be set up where its files are (a path bubblewrap cannot bind).

    Raised when the sandbox is made, and by a command whose sandbox failed to start
    (nothing of the command ran): never an observation or a graded patch.
    """


class OptionError(Error, ValueError):
    """An option is out of its allowed range or of the wrong type; the message names both."""


class ScheduleError(Error, ValueError):
    """A branch schedule is unknown, or lacks the inputs it needs (exact values, a teacher)."""


class ExecutorError(Error, RuntimeError):
    """A sibling executor cannot run (bad worker count, a pool that was shut down)."""


class EngineError(Error, ValueError):
    """A generation engine got a request it cannot serve (prompt too long, bad model folder)."""


class TrainingConfigError(Error, ValueError):
    """A learner's options are invalid (unknown algorithm or variant, a value out of range)."""


class IntegrationError(Error, RuntimeError):
    """An installed trainer (TRL) differs from the version whose internals an integration wraps."""


class CheckpointError(Error, ValueError):
    """A training checkpoint is missing, damaged, or from another algorithm or model."""


class RemoteError(Error, RuntimeError):
    """A served env (``branchgym serve``) refused a request, or its connection broke.

    Attributes:
        code: The protocol's error code (``VALIDATION_ERROR``, ``MESSAGE_TOO_LARGE``,
            ``CAPACITY_REACHED``, ``CONNECTION_LOST``, ...); see docs/serving.md.
    """

    def __init__(self, message: str = "", code: str = "SESSION_ERROR") -> None:
        super().__init__(message)
        self.code = code


class RemoteAuthError(RemoteError, PermissionError):
    """A served env refused the connection's token (missing or wrong)."""


class ForeignSnapshotError(SnapshotMismatchError):
    """A remote snapshot id was used on another server, or is unknown (released) on its own."""


class EndpointError(Error, RuntimeError):
    """An OpenAI-compatible endpoint answered garbage or not at all.

    Raised by ``branchgym.evaluation.endpoint.EndpointPolicy`` for failures of the
    infrastructure, never of the agent: nothing listening, a timeout, an HTTP error after
    the bounded retries, a wrong model name, a body that is not chat-completions JSON. A
    reply the env cannot parse is not one (the env answers it with its invalid-action
    feedback). The message says what to check (the server, the URL, the model name).

    Attributes:
        url: The URL that failed.
        status: The HTTP status, or ``None`` when no HTTP answer came.
    """

    def __init__(self, message: str = "", url: str | None = None, status: int | None = None):
        super().__init__(message)
        self.url = url
        self.status = status


class EndpointAuthError(EndpointError, PermissionError):
    """An endpoint's API key is missing (the named environment variable is unset) or refused."""
