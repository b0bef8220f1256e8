"""Wrapper state: what of each Gymnasium wrapper a snapshot copies, and how it is read.

A wrapper class declares its state with :func:`register_wrapper_state`,
:func:`declare_stateless` or a ``branchgym_state_attrs`` class attribute; Gymnasium's own
wrappers are declared here, in a table (``_register_gymnasium_wrappers``). The snapshot
operations of :mod:`branchgym.core` and the stack wrappers read it through
:func:`wrapper_state_handler`, :func:`walk_wrappers`, :func:`read_wrapper_state` and
:func:`capture_wrapper_state`; a wrapper whose class declared nothing makes them fail
loudly (:class:`~branchgym.error.UnsnapshottableWrapperError`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from branchgym.error import UnsnapshottableWrapperError, WrapperStateError

__all__ = [
    "register_wrapper_state",
    "declare_stateless",
    "wrapper_state_handler",
    "walk_wrappers",
    "read_wrapper_state",
    "capture_wrapper_state",
    "class_path",
]


def _apply_observation(wrapper: gym.Wrapper, obs: Any) -> Any:
    return wrapper.observation(obs)  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class _WrapperState:
    attrs: tuple[str, ...] = ()
    volatile: tuple[str, ...] = ()
    observe: Callable[[gym.Wrapper, Any], Any] | None = None


_HANDLERS: dict[type, _WrapperState] = {}


def register_wrapper_state(
    cls: type[gym.Wrapper],
    attrs: tuple[str, ...] = (),
    *,
    volatile: tuple[str, ...] = (),
    observe: Callable[[gym.Wrapper, Any], Any] | None = None,
) -> None:
    """Teach branchgym how to capture the state of a wrapper class.

    Args:
        cls: The wrapper class (matched exactly, not subclasses: a subclass may add state).
        attrs: Attribute names deep-copied into the snapshot and back on restore.
        volatile: The subset of ``attrs`` left out of ``state_digest`` (wall-clock times).
        observe: For observation wrappers, ``observe(wrapper, inner_obs) -> obs`` computes
            the outer observation after restore. Default for an ``ObservationWrapper``:
            ``wrapper.observation(inner_obs)``, right only if that call is pure once the
            attributes are restored.
    """
    if observe is None and issubclass(cls, gym.ObservationWrapper):
        observe = _apply_observation
    _HANDLERS[cls] = _WrapperState(tuple(attrs), tuple(volatile), observe)


def declare_stateless(*classes: type[gym.Wrapper]) -> None:
    """Declare wrappers that hold no state affecting future behaviour."""
    for cls in classes:
        register_wrapper_state(cls, ())


def wrapper_state_handler(wrapper: gym.Wrapper) -> _WrapperState:
    """How branchgym captures ``wrapper``'s state: its ``attrs``, ``volatile`` and ``observe``.

    Wrapper classes declare this with :func:`register_wrapper_state`,
    :func:`declare_stateless` or a ``branchgym_state_attrs`` class attribute.

    Raises:
        UnsnapshottableWrapperError: the wrapper's class declared nothing.
    """
    cls = type(wrapper)
    h = _HANDLERS.get(cls)
    if h is not None:
        return h
    declared = cls.__dict__.get("branchgym_state_attrs")
    if declared is not None:
        register_wrapper_state(cls, tuple(declared))
        return _HANDLERS[cls]
    raise UnsnapshottableWrapperError(
        f"wrapper {cls.__module__}.{cls.__qualname__} holds state branchgym does not know how "
        "to snapshot. Declare it: give the class `branchgym_state_attrs = (...)` (attribute "
        "names to copy; `()` if stateless), or call branchgym.register_wrapper_state("
        f"{cls.__qualname__}, attrs=...) / branchgym.declare_stateless({cls.__qualname__})."
    )


def class_path(cls: type) -> str:
    """``module.QualName`` of ``cls``: how a snapshot names the wrapper layers it holds."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _frame_stack_observe(wrapper: Any, obs: Any) -> Any:
    from gymnasium.vector.utils import concatenate

    return copy.deepcopy(
        concatenate(wrapper.env.observation_space, wrapper.obs_queue, wrapper.stacked_obs)
    )


def _normalize_obs_observe(wrapper: Any, obs: Any) -> Any:
    update = wrapper._update_running_mean
    wrapper._update_running_mean = False
    try:
        return wrapper.observation(obs)
    finally:
        wrapper._update_running_mean = update


def _register_gymnasium_wrappers() -> None:
    w = gym.wrappers
    register_wrapper_state(w.TimeLimit, ("_elapsed_steps",))
    register_wrapper_state(w.OrderEnforcing, ("_has_reset",))
    register_wrapper_state(
        w.PassiveEnvChecker,
        ("checked_reset", "checked_step", "checked_render", "checked_data_reuse", "_previous_data"),
        volatile=(
            "checked_reset",
            "checked_step",
            "checked_render",
            "checked_data_reuse",
            "_previous_data",
        ),
    )
    register_wrapper_state(
        w.RecordEpisodeStatistics,
        (
            "episode_count",
            "episode_start_time",
            "episode_returns",
            "episode_lengths",
            "time_queue",
            "return_queue",
            "length_queue",
        ),
        volatile=("episode_start_time", "time_queue"),
    )
    register_wrapper_state(w.Autoreset, ("autoreset",))
    register_wrapper_state(
        w.StickyAction, ("last_action", "is_sticky_actions", "num_repeats", "repeats_taken")
    )
    register_wrapper_state(w.TimeAwareObservation, ("timesteps",))
    register_wrapper_state(
        w.FrameStackObservation,
        ("obs_queue", "stacked_obs", "padding_value"),
        observe=_frame_stack_observe,
    )
    register_wrapper_state(
        w.NormalizeObservation,
        ("obs_rms", "_update_running_mean"),
        observe=_normalize_obs_observe,
    )
    register_wrapper_state(
        w.NormalizeReward, ("return_rms", "discounted_reward", "_update_running_mean")
    )
    register_wrapper_state(w.MaxAndSkipObservation, ("_obs_buffer",))
    declare_stateless(
        w.TransformObservation,
        w.FilterObservation,
        w.FlattenObservation,
        w.GrayscaleObservation,
        w.ResizeObservation,
        w.ReshapeObservation,
        w.RescaleObservation,
        w.DtypeObservation,
        w.TransformAction,
        w.ClipAction,
        w.RescaleAction,
        w.TransformReward,
        w.ClipReward,
        w.RepeatAction,
        w.HumanRendering,
        w.AddWhiteNoise,
        w.ObstructView,
    )
    for name in ("DiscretizeAction", "DiscretizeObservation"):
        if hasattr(w, name):
            declare_stateless(getattr(w, name))
    # Deliberately unknown (snapshot() raises): RecordVideo and RenderCollection keep
    # recorded frames; DelayObservation's current output is not recoverable from its queue.


def walk_wrappers(env: gym.Env) -> list[gym.Wrapper]:
    """Every wrapper from ``env`` down to the base env; unknown ones raise."""
    out: list[gym.Wrapper] = []
    e: Any = env
    while isinstance(e, gym.Wrapper):
        wrapper_state_handler(e)
        out.append(e)
        e = e.env
    return out


def read_wrapper_state(wrapper: gym.Wrapper, *, digest: bool = False) -> dict[str, Any]:
    """The declared state attributes of one wrapper, by name (the live values, not copies).

    Args:
        wrapper: One layer of a stack.
        digest: Leave out the attributes declared volatile (what ``state_digest`` hashes).

    Raises:
        UnsnapshottableWrapperError: the wrapper's class declared nothing.
        WrapperStateError: the wrapper lacks a declared attribute (for Gymnasium's own
            wrappers: a Gymnasium version whose private names differ from the table's).
    """
    h = wrapper_state_handler(wrapper)
    out = {}
    for name in h.attrs:
        if digest and name in h.volatile:
            continue
        try:
            out[name] = getattr(wrapper, name)
        except AttributeError:
            cls = type(wrapper)
            raise WrapperStateError(
                f"wrapper {class_path(cls)} has no attribute {name!r}, which branchgym's state "
                f"declaration for it names (declared: {', '.join(h.attrs)}; gymnasium "
                f"{gym.__version__}). Use a gymnasium version pyproject allows, or declare "
                f"this version's state: branchgym.register_wrapper_state({cls.__qualname__}, "
                "attrs=(...)), or branchgym.declare_stateless(...) if it holds none."
            ) from None
    return out


def capture_wrapper_state(wrapper: gym.Wrapper) -> dict[str, Any]:
    """Deep copies of the declared state attributes of one wrapper, by name."""
    return copy.deepcopy(read_wrapper_state(wrapper))


_register_gymnasium_wrappers()
