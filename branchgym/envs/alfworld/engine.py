"""The ALFWorld engine: textworld's ``PddlEnv`` over fast-downward, with fast state save/restore.

ALFWorld's text games are textworld ``PddlEnv`` games: fast-downward (a C++ library behind
ctypes) holds the planning state; textworld keeps a Python-side fact set and renders the
text with its grammar; alfworld's ``AlfredDemangler`` turns PDDL ids into names like
``mug 1``. :class:`Engine` plays one game the way alfworld's ``AlfredTWEnv`` does (same
admissible commands, same ``"Nothing happens."`` for anything else, ``won`` from the
planner's goal test) and adds what branching needs:

* **Isolation.** fast-downward keeps its state in C++ globals. textworld loads a private
  copy of ``libdownward.so`` per ``PddlEnv`` (``fast_downward.load_lib`` copies the file
  before ``dlopen``), so each engine has its own globals; the one symbol the copies share
  (the plugin registry, a ``STB_GNU_UNIQUE`` static) is only used while a copy loads.
  Unloading a copy while others are loaded crashes the next load, so copies are never
  ``dlclose``-d: :meth:`Engine.close` frees the copy's task and returns it to a
  process-wide pool that the next engine reuses (mapped memory stays bounded by the
  number of engines alive at once, about 34 MB of address space each).
* **Fast path** (:meth:`Engine.capture` / :meth:`Engine.restore_fast`): fast-downward's
  state registry keeps every visited state, and the library exports
  ``get_state_id``/``set_state_id`` (textworld does not declare them). A capture is that
  id plus a copy of the Python side (facts, the last game state); restoring it is valid
  in the engine that took it, as long as no other task was loaded there since (``epoch``).
* **Portable path** (:meth:`Engine.restore_facts`): rebuild a PDDL problem whose
  ``:init`` is the current facts, translate and load it, then put back the exact
  Python-side fact set (textworld's facts also remember negated effects, which the text
  grammar queries). Works in any engine, in any process.

Translations and parsed grammars are cached per process, so resetting to a game an engine
has seen, or restoring one snapshot into K sibling engines, translates once.

Why this module is over 600 lines: the library pool, the translation cache, the game
logic and the state capture all act on one loaded copy of ``libdownward`` and share its
invariants (a copy is never ``dlclose``-d; a fast capture is valid only in its epoch).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import json
import re
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

from branchgym.error import DependencyMissingError, GameLoadError

__all__ = [
    "ENGINE_VERSIONS",
    "INSTALL_HINT",
    "Engine",
    "EngineCapture",
    "EngineLoadError",
    "Fact",
    "ProblemLike",
    "alfred_domain",
    "alfred_grammar",
    "clear_game_caches",
    "engine_available",
    "require_engine",
    "set_parse_cache",
]

#: The engine versions this adapter is written and tested against.
ENGINE_VERSIONS = {"alfworld": "0.4.2", "textworld": "1.7.0", "fast-downward-textworld": "20.6.4"}

INSTALL_HINT = (
    "Install the ALFWorld engine without its heavy optional dependencies (spaCy, torch):\n"
    "  pip install 'branchgym[alfworld]'\n"
    '  PATH="$(dirname $(which python)):$PATH" pip install --no-deps alfworld==0.4.2 '
    "textworld==1.7.0 fast-downward-textworld==20.6.4 jericho==3.3.1\n"
    "(`make alfworld` does both; fast-downward compiles for a few minutes, once.)"
)

EngineLoadError = GameLoadError

#: A fact as plain data: ``(predicate, ((argument, type), ...))``.
Fact = tuple[str, tuple[tuple[str, str], ...]]


class ProblemLike(Protocol):
    """What the engine reads of a game: :class:`~branchgym.envs.alfworld.tasks.Problem` is one.

    The engine sits under the problem format (a problem's ``game()`` reads the domain and
    grammar from :func:`alfred_domain` and :func:`alfred_grammar`), so it names what it
    uses instead of importing the class.
    """

    @property
    def key(self) -> str:
        """Stable hash of everything that defines the game (its caches are keyed by it)."""

    @property
    def goal(self) -> str:
        """The task as the agent reads it."""

    @property
    def pddl_problem(self) -> str:
        """The PDDL problem text."""

    def game(self) -> dict[str, str]:
        """The game dict textworld's ``PddlEnv.load`` takes (domain, grammar, problem)."""


_NOTHING_HAPPENS = "Nothing happens."


# --------------------------------------------------------------------- dependencies


@functools.cache
def _import_engine() -> Any:
    """Import textworld, fast-downward and alfworld once; ``None`` if any is missing."""
    try:
        import alfworld.agents.utils.misc  # noqa: F401
        import alfworld.info  # noqa: F401
        import fast_downward  # noqa: F401
        import textworld  # noqa: F401
        import textworld.envs.pddl  # noqa: F401
        from textworld.envs.pddl import logic  # noqa: F401

        # The translator parses sys.argv when its options module is first imported.
        with _translator_argv():
            import fast_downward.translate.options  # noqa: F401
            import fast_downward.translate.pddl_parser  # noqa: F401
    except ImportError:
        return None
    set_parse_cache(True)
    return sys.modules["textworld"]


_PARSE_CACHE: dict[tuple[str, str], Any] = {}
_ORIGINAL_PARSE: Any = None


def set_parse_cache(enabled: bool) -> None:
    """Memoise textworld's grammar-snippet parser (on by default once the engine loads).

    textworld re-parses the same template strings with TatSu on every step (each
    admissible command's template, each feedback rule): most of a step's time. Parsing is
    a pure function of ``(text, rule)``; the memo hands out deep copies because ``derive``
    mutates the parsed symbols. Steps get 2-4x faster and play is unchanged (the tests
    compare whole games with and without it).
    """
    global _ORIGINAL_PARSE
    import copy

    import textworld.envs.pddl.textgen as textgen

    if _ORIGINAL_PARSE is None:
        _ORIGINAL_PARSE = textgen._parse_and_convert
    original = _ORIGINAL_PARSE

    def memoised(text: str, rule_name: str, **kwargs: Any) -> Any:
        if kwargs.get("trace"):
            return original(text, rule_name=rule_name, **kwargs)
        key = (text, rule_name)
        parsed = _PARSE_CACHE.get(key)
        if parsed is None:
            parsed = original(text, rule_name=rule_name)
            if len(_PARSE_CACHE) < 100_000:
                _PARSE_CACHE[key] = parsed
        return copy.deepcopy(parsed)

    textgen._parse_and_convert = memoised if enabled else original


def engine_available() -> bool:
    """True when alfworld, textworld and fast-downward import."""
    return _import_engine() is not None


def require_engine(what: str = "branchgym/ALFWorld-v0") -> None:
    """Raise :class:`DependencyMissingError` (saying how to install) if the engine is missing."""
    if _import_engine() is None:
        raise DependencyMissingError(f"{what} needs the ALFWorld engine. {INSTALL_HINT}")


@functools.cache
def alfred_domain() -> str:
    """Alfworld's shipped ``alfred.pddl``."""
    require_engine("the ALFWorld domain")
    import alfworld.info

    with open(alfworld.info.ALFRED_PDDL_PATH, encoding="utf-8") as f:
        return f.read()


@functools.cache
def alfred_grammar() -> str:
    """Alfworld's shipped ``alfred.twl2`` (goal still ``UNKNOWN GOAL``)."""
    require_engine("the ALFWorld grammar")
    import alfworld.info

    with open(alfworld.info.ALFRED_TWL2_PATH, encoding="utf-8") as f:
        return f.read()


# ------------------------------------------------------------------ library pool


class _LibraryPool:
    """Private copies of ``libdownward.so``, reused instead of unloaded (see module doc)."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.loaded = 0

    def acquire(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        import fast_downward

        lib = fast_downward.load_lib()  # copies the .so: globals private to this engine
        # Exported by the library but not declared by textworld's wrapper.
        lib.get_state_id.argtypes = []
        lib.get_state_id.restype = ctypes.c_int
        lib.set_state_id.argtypes = [ctypes.c_int]
        lib.set_state_id.restype = None
        with self._lock:
            self.loaded += 1
        return lib

    def release(self, lib: Any) -> None:
        lib.cleanup()  # frees the task and its state registry; the mapping stays
        with self._lock:
            self._free.append(lib)


_LIBS = _LibraryPool()


def loaded_library_copies() -> int:
    """How many private copies of ``libdownward.so`` this process has loaded."""
    return _LIBS.loaded


# ------------------------------------------------------------------ translation


_TRANSLATE_LOCK = threading.RLock()


@contextlib.contextmanager
def _translator_argv() -> Iterator[None]:
    """fast-downward's translator parses ``sys.argv`` and its wrapper overwrites it; undo that."""
    saved = sys.argv
    sys.argv = ["translate.py", "domain", "task"]
    try:
        yield
    finally:
        sys.argv = saved


class _LRU:
    def __init__(self, size: int) -> None:
        self.size = size
        self.data: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, key: str) -> Any:
        value = self.data.get(key)
        if value is not None:
            self.data.move_to_end(key)
        return value

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)


_TRANSLATIONS = _LRU(256)


def _digest(*parts: str) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.encode("utf-8"))
        h.update(b"\x00")
    return h.hexdigest()


def _translate(domain: str, problem: str, *, optimize: bool = False) -> tuple[Any, str]:
    """``fast_downward.pddl2sas`` with a process-wide cache; unsolvable goals raise."""
    key = _digest(domain, problem, str(optimize))
    with _TRANSLATE_LOCK:
        hit = _TRANSLATIONS.get(key)
        if hit is not None:
            return hit
        import fast_downward

        try:
            with _translator_argv():
                result = fast_downward.pddl2sas(domain, problem, optimize=optimize)
        except Exception as exc:
            # The translator simplifies an unreachable goal away and then fails looking it
            # up (KeyError 'val1'); malformed PDDL raises SystemExit or parse errors.
            raise GameLoadError(
                f"fast-downward cannot translate this problem ({type(exc).__name__}: {exc}); "
                "its goal is unreachable or the PDDL is malformed. Validate generated problems "
                "with branchgym.envs.alfworld.problems.validate_problem()."
            ) from exc
        except SystemExit as exc:  # the translator exits on bad input
            raise GameLoadError(
                f"fast-downward rejected this problem (exit {exc.code}); the PDDL is malformed."
            ) from exc
        _TRANSLATIONS.put(key, result)
        return result


# ------------------------------------------------------------------ game logic


_LOGICS = _LRU(64)
_TASK_RULE = '"rhs": "Your task is to: UNKNOWN GOAL."'


def _game_logic(domain: str, grammar: str, goal: str) -> Any:
    """Textworld's ``GameLogic`` for a game; the grammar is parsed once per process.

    The grammar differs between games only in the goal sentence (ALFWorld substitutes it
    for ``UNKNOWN GOAL``), so the base grammar is parsed once and each game gets a logic
    whose ``task`` rule is its own; other grammars are parsed whole (and cached).
    """
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.envs.pddl.textgen import ContextSensitiveGrammar

    base = grammar.replace(f"Your task is to: {goal}.", "Your task is to: UNKNOWN GOAL.", 1)
    shared = bool(goal) and base != grammar and base.count(_TASK_RULE) == 1
    key = _digest(domain, base if shared else grammar)
    logic = _LOGICS.get(key)
    if logic is None:
        logic = pddl_logic.GameLogic(domain=domain, grammar=base if shared else grammar)
        _LOGICS.put(key, logic)
    if not shared:
        return logic
    game_logic = pddl_logic.GameLogic.__new__(pddl_logic.GameLogic)
    game_logic.domain = domain
    game_logic.actions = logic.actions
    game_logic.types = logic.types
    game_logic.grammar = ContextSensitiveGrammar()
    game_logic.grammar.update(logic.grammar)
    task = ContextSensitiveGrammar.parse(
        json.dumps({"task": [{"rhs": f"Your task is to: {goal}."}]})
    )
    game_logic.grammar._rules["task"] = list(task._rules["task"])
    return game_logic


# ------------------------------------------------------------------ the state


def _pddl_state_class() -> type:
    """Textworld's ``PddlState`` with cached translations and a lazily translated replan task."""
    cached = globals().get("_PDDL_STATE_CLASS")
    if cached is not None:
        return cached
    import fast_downward
    import textworld
    from textworld.envs.pddl import logic as pddl_logic
    from textworld.logic import Proposition, Variable

    class EnginePddlState(pddl_logic.PddlState):
        """``PddlState`` built like textworld's constructor, minus the eager replan translation.

        The constructor below does what ``PddlState.__init__`` does (translate, load the
        SAS task into the library, import types, read the initial facts), with the
        translations cached per process. The planner's optimised translation (about 4x the
        cost of the plain one) is only needed by :meth:`replan`, so it happens there, once.
        """

        def __init__(self, downward_lib: Any, pddl_problem: str, logic: Any) -> None:
            # As PddlState.__init__ does (State.__init__ only accepts textworld's own logic).
            self._facts = collections.defaultdict(set)
            self._vars_by_name = {}
            self._vars_by_type = collections.defaultdict(set)
            self._var_counts = collections.Counter()
            self._logic = logic
            self.downward_lib = downward_lib
            self.pddl_problem = pddl_problem
            self.task, self.sas = _translate(logic.domain, pddl_problem)
            self.sas_replan = None
            self._actions = {a.name: a for a in self.task.actions}
            for type_ in self.task.types:
                try:
                    self._logic.types.add(textworld.logic.Type(type_.name, type_.supertype_names))
                except ValueError:
                    pass
            self.downward_lib.load_sas(self.sas.encode("utf-8"))
            self.name2type = {o.name: o.type_name for o in self.task.objects}
            facts = []
            for atom in self.task.init:
                if isinstance(atom, fast_downward.translate.pddl.conditions.Atom):
                    if atom.predicate == "=":
                        continue
                    args = [Variable(a, self.name2type[a]) for a in atom.args]
                    facts.append(Proposition(atom.predicate, args))
                elif isinstance(atom, fast_downward.translate.pddl.f_expression.Assign):
                    if atom.fluent.symbol == "total-cost":
                        continue
                    name = f"{atom.expression.value}"
                    if str.isdigit(name):  # distance relations
                        continue
                    args = [Variable(a, self.name2type[a]) for a in atom.fluent.args]
                    facts.append(Proposition(name, args))
            self.add_facts(facts)
            size = self.downward_lib.get_state_size()
            atoms = (pddl_logic.Atom * size)()
            self.downward_lib.get_state(atoms)
            try:
                state_facts = [atom.get_fact(self.name2type) for atom in atoms]
            except KeyError as exc:
                # An unreachable goal is compiled to a placeholder value (KeyError 'val1'
                # in textworld's loader, as with ALFWorld's own unsolvable games).
                raise GameLoadError(
                    f"this problem cannot be loaded: its goal is unreachable from the initial "
                    f"state (fast-downward state atom {exc} is unknown). Validate generated "
                    "problems with branchgym.envs.alfworld.problems.validate_problem()."
                ) from exc
            self.add_facts(f for f in state_facts if not f.is_negation)

        @classmethod
        def at_state(
            cls, downward_lib: Any, pddl_problem: str, logic: Any, sas: str
        ) -> EnginePddlState:
            """The game's own task (``pddl_problem``'s translation) loaded with ``sas``.

            ``sas`` is that translation with another initial state; the caller installs
            the Python-side facts. Commands, effects and the replan task are the game's.
            """
            self = cls.__new__(cls)
            self._facts = collections.defaultdict(set)
            self._vars_by_name = {}
            self._vars_by_type = collections.defaultdict(set)
            self._var_counts = collections.Counter()
            self._logic = logic
            self.downward_lib = downward_lib
            self.pddl_problem = pddl_problem
            self.task, _ = _translate(logic.domain, pddl_problem)
            self.sas = sas
            self.sas_replan = None
            self._actions = {a.name: a for a in self.task.actions}
            self.name2type = {o.name: o.type_name for o in self.task.objects}
            self.downward_lib.load_sas(sas.encode("utf-8"))
            return self

        def replan(self, infos: Any) -> list[str]:
            if self.sas_replan is None:
                _, self.sas_replan = _translate(
                    self._logic.domain, self.pddl_problem, optimize=True
                )
                self.downward_lib.load_sas_replan(self.sas_replan.encode("utf-8"))
            return super().replan(infos)

    globals()["_PDDL_STATE_CLASS"] = EnginePddlState
    return EnginePddlState


def fact_data(prop: Any) -> Fact:
    """A TextWorld proposition as plain data: ``(name, ((variable, type), ...))``."""
    return (prop.name, tuple((v.name, v.type) for v in prop.arguments))




def _proposition(fact: Fact) -> Any:
    from textworld.logic import Proposition, Variable

    name, args = fact
    return Proposition(name, [Variable(n, t) for n, t in args])


@dataclasses.dataclass
class _Facts:
    """A copy of textworld's Python-side state containers (facts and their variables)."""

    facts: dict[Any, set[Any]]
    vars_by_name: dict[str, Any]
    vars_by_type: dict[str, set[Any]]
    var_counts: collections.Counter[str]

    @classmethod
    def of(cls, state: Any) -> _Facts:
        return cls(
            {k: set(v) for k, v in state._facts.items() if v},
            dict(state._vars_by_name),
            {k: set(v) for k, v in state._vars_by_type.items()},
            collections.Counter(state._var_counts),
        )

    def install(self, state: Any) -> None:
        state._facts = collections.defaultdict(set, {k: set(v) for k, v in self.facts.items()})
        state._vars_by_name = dict(self.vars_by_name)
        state._vars_by_type = collections.defaultdict(
            set, {k: set(v) for k, v in self.vars_by_type.items()}
        )
        state._var_counts = collections.Counter(self.var_counts)

    def propositions(self) -> set[Any]:
        return {p for v in self.facts.values() for p in v}


_ATOM = re.compile(r"^(Atom|NegatedAtom) ([^(]+)\((.*)\)$")


@dataclasses.dataclass
class _SasTemplate:
    """A game's SAS task split around its initial state, to load it at another state.

    The translator keeps every fluent atom reachable from the initial state as a variable,
    and every state reached in play is reachable from it, so any such state is the same
    task with another ``begin_state`` section: no new translation is needed.
    """

    head: str  # up to and including "begin_state\n"
    tail: str  # from "end_state\n"
    layers: list[int]  # axiom layer per variable (-1: not derived)
    values: list[list[tuple[bool, tuple[str, tuple[str, ...]]] | None]]
    initial: list[int]
    fluents: frozenset[tuple[str, tuple[str, ...]]]  # atoms that are variable values

    @classmethod
    def parse(cls, sas: str) -> _SasTemplate:
        lines = sas.split("\n")
        layers: list[int] = []
        values: list[list[Any]] = []
        i = 0
        while i < len(lines) and lines[i] != "begin_state":
            if lines[i] == "begin_variable":
                layer, n = int(lines[i + 2]), int(lines[i + 3])
                vals = []
                for name in lines[i + 4 : i + 4 + n]:
                    m = _ATOM.match(name)
                    if m is None:
                        vals.append(None)  # "<none of those>"
                        continue
                    args = tuple(a for a in m.group(3).split(", ") if a)
                    vals.append((m.group(1) == "Atom", (m.group(2), args)))
                layers.append(layer)
                values.append(vals)
                i += 4 + n
                continue
            i += 1
        start = i + 1
        end = start + len(values)
        if lines[end] != "end_state":
            raise GameLoadError("unexpected SAS layout: the initial state is not one value a line")
        fluents = frozenset(v[1] for vals in values for v in vals if v is not None and v[0])
        return cls(
            head="\n".join(lines[:start]) + "\n",
            tail="\n".join(lines[end:]),
            layers=layers,
            values=values,
            initial=[int(x) for x in lines[start:end]],
            fluents=fluents,
        )

    def at(
        self, true_atoms: set[tuple[str, tuple[str, ...]]], static_atoms: frozenset[Any]
    ) -> str | None:
        """The SAS text with ``true_atoms`` as initial state; ``None`` if not representable."""
        if true_atoms - self.fluents != static_atoms:
            return None  # not a state of this task (a damaged or foreign snapshot)
        state = []
        for layer, vals, init in zip(self.layers, self.values, self.initial, strict=True):
            if layer >= 0:  # derived: fast-downward evaluates the axioms itself
                state.append(init)
                continue
            true = [k for k, v in enumerate(vals) if v is not None and v[0] and v[1] in true_atoms]
            if len(true) > 1:
                return None
            if not true:
                false = [k for k, v in enumerate(vals) if v is None or not v[0]]
                if len(false) != 1:
                    return None
                true = false
            state.append(true[0])
        return self.head + "\n".join(map(str, state)) + "\n" + self.tail


@dataclasses.dataclass
class _GameStatic:
    """What a game always starts from, computed once per process per game."""

    #: Shared by every state of the game: not part of any one snapshot's memory.
    __branchgym_shared__: ClassVar[bool] = True

    key: str
    domain: str
    logic: Any
    entity_infos: dict[str, Any]
    initial: _Facts
    initial_facts: frozenset[Any]
    parsed: list[Any]  # the problem as nested lists, for rebuilding its :init
    sas: _SasTemplate
    static_atoms: frozenset[Any]  # true atoms that are not SAS variables (never change)


_STATICS = _LRU(256)


def clear_game_caches() -> None:
    """Forget every game's translation and per-game setup (the base grammar stays).

    The next restore of a portable snapshot then costs what it costs in a process that
    has never seen the game (what ``branchgym bench snapshot`` times as "cold").
    """
    _TRANSLATIONS.data.clear()
    _STATICS.data.clear()


def _atom_keys(facts: _Facts) -> set[tuple[str, tuple[str, ...]]]:
    return {
        (p.name, tuple(v.name for v in p.arguments))
        for p in facts.propositions()
        if not p.name.startswith("not_")
    }


def _entity_infos(state: Any) -> dict[str, Any]:
    """What ``PddlEnv._get_entity_infos`` and then ``AlfredDemangler.load`` compute."""
    from alfworld.agents.utils.misc import Demangler
    from textworld.generator.game import EntityInfo

    infos = {v.name: EntityInfo(v.name, v.type) for fact in state.facts for v in fact.arguments}
    for info in infos.values():
        info.name = info.id
        info.definite = "the"
        info.indefinite = "a"
    demangler = Demangler(game_infos=infos, shuffle=False)
    for info in infos.values():
        info.name = demangler.demangle_alfred_name(info.id)
    return infos


def _sexpr(node: Any) -> str:
    if isinstance(node, list):
        return "(" + " ".join(_sexpr(n) for n in node) + ")"
    return str(node)


def fact_delta(static: _GameStatic, facts: _Facts) -> tuple[tuple[Fact, ...], tuple[Fact, ...]]:
    """Facts added to and removed from the game's initial facts (portable, sorted)."""
    current = facts.propositions()
    initial = static.initial_facts
    added = tuple(sorted(fact_data(p) for p in current - initial))
    removed = tuple(sorted(fact_data(p) for p in initial - current))
    return added, removed


@dataclasses.dataclass
class EngineCapture:
    """An engine's state, saved in-process (the fast path). Valid only in its engine.

    Attributes:
        engine: Weak reference to the engine that took it.
        epoch: The engine's task generation then; a later load invalidates the state id.
        state_id: fast-downward's id of the state in that task's state registry.
        facts: Copy of textworld's Python-side fact containers.
        game_state: Shallow copy of textworld's last ``GameState``.
        operators: The applicable operators textworld resolved commands against.
        last_action: textworld's last applied action.
        moves: textworld's move counter.
    """

    engine: weakref.ReferenceType[Engine]
    epoch: int
    game_key: str
    state_id: int
    facts: _Facts
    game_state: Any
    operators: Any
    last_action: Any
    moves: int


class Engine:
    """One ALFWorld game engine: a textworld ``PddlEnv`` with its own fast-downward copy."""

    def __init__(self) -> None:
        """Take a private library copy from the pool and set up textworld's ``PddlEnv``."""
        require_engine()
        import textworld
        from textworld.envs.pddl import PddlEnv

        self._lib = _LIBS.acquire()
        # PddlEnv.__init__ would load yet another library copy; do what it does with ours.
        env = PddlEnv.__new__(PddlEnv)
        textworld.Environment.__init__(env, textworld.EnvInfos(admissible_commands=True, won=True))
        env.downward_lib = self._lib
        self._env = env
        self._static: _GameStatic | None = None
        self._initial: EngineCapture | None = None
        self.epoch = 0
        self.closed = False
        #: Portable restores load the game's own task at the saved state (``sas``); with
        #: False (or when a state is not one of the task's) a PDDL problem is rebuilt from
        #: the facts and translated (``pddl``). ``last_portable_route`` says which ran.
        self.prefer_sas = True
        self.last_portable_route: str | None = None
        self._finalizer = weakref.finalize(self, _LIBS.release, self._lib)

    # ------------------------------------------------------------------ loading
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this ALFWorld engine was closed; make a new env")

    def _static_for(self, problem: ProblemLike) -> _GameStatic:
        key = problem.key
        static = _STATICS.get(key)
        if static is None:
            static = self._build_static(problem)
            _STATICS.put(key, static)
        return static

    def _build_static(self, problem: ProblemLike) -> _GameStatic:
        from fast_downward.translate.pddl_parser import lisp_parser

        game = problem.game()
        domain = game["pddl_domain"]
        logic = _game_logic(domain, game["grammar"], problem.goal)
        state = _pddl_state_class()(self._lib, game["pddl_problem"], logic)
        self.epoch += 1  # the library holds a new task: earlier state ids are void
        with _TRANSLATE_LOCK, _translator_argv():
            parsed = lisp_parser.parse_nested_list(game["pddl_problem"].split("\n"))
        facts = _Facts.of(state)
        sas = _SasTemplate.parse(state.sas)
        return _GameStatic(
            key=problem.key,
            domain=domain,
            logic=logic,
            entity_infos=_entity_infos(state),
            initial=facts,
            initial_facts=frozenset(facts.propositions()),
            parsed=parsed,
            sas=sas,
            static_atoms=frozenset(_atom_keys(facts) - sas.fluents),
        )

    def load(self, problem: ProblemLike) -> None:
        """Make ``problem`` the game of this engine (textworld's ``PddlEnv.load``)."""
        self._check_open()
        static = self._static_for(problem)
        self._static = static
        self._initial = None
        env = self._env
        env._game_data = problem.game()
        env._game_file = None
        env.walkthrough = None
        env._logic = static.logic
        env._entity_infos = static.entity_infos
        self._load_task(problem.pddl_problem)

    def _load_task(self, pddl_problem: str) -> None:
        """Translate (cached) and load a task; resets the library's state registry."""
        static = self._static
        if static is None:  # pragma: no cover - guarded by callers
            raise RuntimeError("load a game first")
        self._env._pddl_state = _pddl_state_class()(self._lib, pddl_problem, static.logic)
        self.epoch += 1

    @property
    def game_key(self) -> str:
        """Key of the loaded game."""
        if self._static is None:
            raise RuntimeError("no game loaded")
        return self._static.key

    # ------------------------------------------------------------------ play
    def reset(self) -> Any:
        """Start the loaded game over (textworld's ``PddlEnv.reset``); returns its GameState.

        The first reset builds the initial state the way ``PddlEnv.reset`` does; later
        ones restore it through the fast path when the game's task is still loaded.
        """
        self._check_open()
        if self._static is None:
            raise RuntimeError("load a game before reset()")
        if self._initial is not None and self._fast_ok(self._initial):
            self.restore_fast(self._initial)
            return self._env.state
        # A fresh task: its state registry starts at the initial state.
        self._load_task(self._env._game_data["pddl_problem"])
        from textworld.core import GameState

        env = self._env
        static = self._static
        static.initial.install(env._pddl_state)
        env.prev_state = None
        env.state = GameState()
        env._last_action = None
        env._moves = 0
        context = {
            "state": env._pddl_state,
            "facts": list(env._pddl_state.facts),
            "variables": {},
            "mapping": {},
            "entity_infos": env._entity_infos,
        }
        env.state.feedback = env._logic.grammar.derive("#intro#", context)
        env.state.raw = env.state.feedback
        env._gather_infos()
        self._initial = self.capture()
        return env.state

    def step(self, command: str) -> tuple[Any, int, bool]:
        """Textworld's ``PddlEnv.step``: ``(GameState, score, done)``."""
        self._check_open()
        return self._env.step(command)

    @property
    def state(self) -> Any:
        """Textworld's current ``GameState``."""
        return self._env.state

    @property
    def moves(self) -> int:
        """Successful actions since reset."""
        return int(self._env._moves)

    def replan(self) -> list[str]:
        """The planner's plan from the current state, as commands (empty if none)."""
        self._check_open()
        return list(self._env._pddl_state.replan(self._env._entity_infos))

    # ------------------------------------------------------------------ fast path
    def capture(self) -> EngineCapture:
        """Save the state in-process: the library's state id plus the Python side."""
        self._check_open()
        env = self._env
        state = env._pddl_state
        return EngineCapture(
            engine=weakref.ref(self),
            epoch=self.epoch,
            game_key=self.game_key,
            state_id=int(self._lib.get_state_id()),
            facts=_Facts.of(state),
            game_state=type(env.state)(env.state),
            operators=getattr(state, "_operators", None),
            last_action=env._last_action,
            moves=int(env._moves),
        )

    def _fast_ok(self, capture: EngineCapture) -> bool:
        return (
            not self.closed
            and capture.engine() is self
            and capture.epoch == self.epoch
            and self._static is not None
            and capture.game_key == self._static.key
        )

    def can_restore_fast(self, capture: EngineCapture | None) -> bool:
        """Whether ``capture`` was taken here and its state id is still valid."""
        return capture is not None and self._fast_ok(capture)

    def restore_fast(self, capture: EngineCapture) -> None:
        """Restore a capture taken by this engine since its task was last loaded."""
        if not self._fast_ok(capture):
            raise RuntimeError("capture is not restorable here (other engine or task reloaded)")
        env = self._env
        state = env._pddl_state
        self._lib.set_state_id(capture.state_id)
        capture.facts.install(state)
        if capture.operators is not None:
            state._operators = capture.operators
        env.state = type(capture.game_state)(capture.game_state)
        env.prev_state = None
        env._last_action = capture.last_action
        env._moves = capture.moves

    # ------------------------------------------------------------------ portable path
    @property
    def static(self) -> _GameStatic:
        """What the loaded game starts from (its initial facts, task, names)."""
        if self._static is None:
            raise RuntimeError("no game loaded")
        return self._static

    def facts_from_delta(self, added: tuple[Fact, ...], removed: tuple[Fact, ...]) -> _Facts:
        """The Python-side containers of the state ``(added, removed)`` describes."""
        if self._static is None:
            raise RuntimeError("no game loaded")
        base = self._static.initial
        drop = {_proposition(f) for f in removed}
        facts: dict[Any, set[Any]] = {k: set(v) - drop for k, v in base.facts.items()}
        for fact in added:
            prop = _proposition(fact)
            facts.setdefault(prop.signature, set()).add(prop)
        # textworld's variable counts never change over an episode (each effect removes
        # the negated fact, present or not, then adds the fact), so the initial ones hold.
        return _Facts(facts, base.vars_by_name, base.vars_by_type, base.var_counts)

    def rebuilt_problem(self, facts: _Facts) -> str:
        """The game's PDDL problem with ``:init`` replaced by ``facts`` (negations dropped)."""
        if self._static is None:
            raise RuntimeError("no game loaded")
        init: list[Any] = [":init"]
        for item in self._static.parsed:
            if isinstance(item, list) and item and item[0] == ":init":
                init += [f for f in item[1:] if isinstance(f, list) and f and f[0] == "="]
        atoms = sorted(fact_data(p) for p in facts.propositions() if not p.name.startswith("not_"))
        init += [[name, *(a for a, _ in args)] for name, args in atoms]
        parts = [
            init if isinstance(item, list) and item and item[0] == ":init" else item
            for item in self._static.parsed
        ]
        return _sexpr(parts)

    def restore_facts(
        self, facts: _Facts, *, feedback: str, last_command: str | None, moves: int
    ) -> None:
        """Bring the engine to the state ``facts`` describe (portable path).

        Loads a task whose initial state is that state, reinstalls the exact Python-side
        facts, and rebuilds the game state (admissible commands, ``won``) from it.
        """
        self._check_open()
        from textworld.core import GameState

        static = self._static
        if static is None:
            raise RuntimeError("load a game first")
        sas = static.sas.at(_atom_keys(facts), static.static_atoms) if self.prefer_sas else None
        if sas is not None:
            pddl_problem = self._env._game_data["pddl_problem"]
            self._env._pddl_state = _pddl_state_class().at_state(
                self._lib, pddl_problem, static.logic, sas
            )
            self.epoch += 1
            self.last_portable_route = "sas"
        else:
            self._load_task(self.rebuilt_problem(facts))
            self.last_portable_route = "pddl"
        env = self._env
        facts.install(env._pddl_state)
        env.prev_state = None
        env.state = GameState()
        env._last_action = None
        env._moves = int(moves)
        env.state.feedback = feedback
        env.state.raw = feedback
        if last_command is not None:
            env.state.last_command = last_command
        env._gather_infos()
        self._initial = None  # the game's own task is no longer loaded

    def current_facts(self) -> _Facts:
        """A copy of the Python-side fact containers."""
        return _Facts.of(self._env._pddl_state)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free the task and return the library copy to the pool. Idempotent."""
        if not self.closed:
            self.closed = True
            self._initial = None
            self._finalizer()  # runs _LIBS.release exactly once
