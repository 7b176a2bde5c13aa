"""Where Python source changes the process's environment, found by reading
it (``ast``), never by running it: a write in a branch that runs only on a
GPU, under Ray or on another platform is seen on any machine, which is the
point (vLLM's GPU worker removed a variable the project relied on, and the
suite, on vLLM's CPU worker, never ran that line).

Used by tests/unit/test_environment_writes.py (the project's own writes stay
in a few places) and tests/unit/test_vllm_environment.py (vLLM's writes stay
off the names the project sets).

A write is any of:

- ``os.environ[NAME] = ...`` (also augmented, or as one target of an
  unpacking), ``del os.environ[NAME]``;
- ``os.environ``'s writing methods (:data:`WRITING_METHODS`), among them
  ``pop``, ``setdefault``, ``update`` (a dict literal's keys and keyword
  names) and ``os.environ |= {...}``;
- ``os.putenv`` / ``os.unsetenv`` (:data:`OS_FUNCTIONS`);
- vLLM's helpers that write it for their caller (:data:`HELPERS`);

whether ``os`` is imported under another name, or ``environ``, ``putenv``,
``unsetenv`` or a helper is imported by name.

A variable's name is resolved from a string literal, a string constant of
the module (or one imported from a module under the same root), or, in a
function, a loop variable over the keys of a dict the function builds from
such names and changes in no other way (vLLM sets OpenMP's settings so).
Any other expression is reported as ``?`` and its source, never skipped.

Not seen: an alias a module makes itself (``env = os.environ``), a write
through ``mock.patch.dict``, a helper not in :data:`HELPERS`, and C code
calling ``setenv``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

#: ``os.environ``'s methods that change it, and how each does.
WRITING_METHODS: dict[str, str] = {
    "__setitem__": "set", "__delitem__": "delete", "pop": "pop", "setdefault": "default",
    "update": "update", "__ior__": "update", "popitem": "popitem", "clear": "clear"}
#: ``os``'s functions that change the process's environment (behind
#: ``os.environ``'s back: it keeps the old value), and how each does.
OS_FUNCTIONS: dict[str, str] = {"putenv": "putenv", "unsetenv": "unsetenv"}
#: vLLM's helpers that write the environment for their caller, and how:
#: ``update_environment_variables`` (``vllm/utils/system_utils.py``) sets
#: each key of the dict it is given, ``set_env_var`` (the same module) sets
#: a variable until the block it opens ends, and ``pin_nccl_env``
#: (``vllm/utils/nccl.py``) sets each key of its dict for the process's own
#: NCCL communicators. Each is listed where it is called, with the names
#: its caller gives it; its own body writes names it cannot know.
HELPERS: dict[str, str] = {"update_environment_variables": "update",
                           "set_env_var": "set-temporarily", "pin_nccl_env": "pin"}
#: The name recorded for a write that may change any variable (``clear``,
#: ``popitem``).
EVERY_NAME = "*"
#: Writes whose first argument is a mapping of names to values.
_TAKES_MAPPING = frozenset({"update", "__ior__", "update_environment_variables",
                            "pin_nccl_env"})
#: Writes that name no variable.
_TAKES_NOTHING = frozenset({"popitem", "clear"})
#: A dict's methods that only read it: a dict used only through these (and
#: subscripts, loops and ``in``) has no keys but those the function sets.
_READING_METHODS = frozenset({"get", "items", "keys", "values", "copy"})

#: A function, whose own names shadow the module's.
Function = ast.FunctionDef | ast.AsyncFunctionDef
#: What a write's ``scope`` is made of.
Scope = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclass(frozen=True)
class Aliases:
    """The names one module gives ``os``, ``os.environ`` and the functions
    that write the environment. The defaults are those of a module that
    only does ``import os``."""

    os: frozenset[str] = frozenset({"os"})
    environ: frozenset[str] = frozenset()
    functions: dict[str, str] = field(default_factory=dict)
    """Local name -> the function it is (a key of :data:`OS_FUNCTIONS` or :data:`HELPERS`)."""

    @classmethod
    def of(cls, tree: ast.Module) -> Aliases:
        """The aliases ``tree`` imports anywhere in it (an import in a
        function is taken as the module's: a name is rarely rebound)."""
        os_names, environ_names, functions = {"os"}, set(), {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                os_names |= {alias.asname for alias in node.names
                             if alias.name == "os" and alias.asname}
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    local = alias.asname or alias.name
                    if node.module == "os" and alias.name == "environ":
                        environ_names.add(local)
                    elif node.module == "os" and alias.name in OS_FUNCTIONS:
                        functions[local] = alias.name
                    elif alias.name in HELPERS:
                        functions[local] = alias.name
        return cls(frozenset(os_names), frozenset(environ_names), functions)


@dataclass(frozen=True)
class EnvironmentWrite:
    """One variable that one statement writes."""

    file: str
    """The source file, relative to the root it was read under."""
    line: int
    name: str
    """The variable; ``?`` and the expression where it was not resolved;
    :data:`EVERY_NAME` for a write that may change any."""
    how: str
    """``set`` or ``delete`` (a subscript), or a value of
    :data:`WRITING_METHODS`, :data:`OS_FUNCTIONS` or :data:`HELPERS`
    (``pop``, ``default``, ``update``, ``set-temporarily``, ...)."""
    scope: str
    """The enclosing classes and functions, dotted (``Worker.init_device``);
    empty at the module's top level."""

    def __str__(self) -> str:
        return f"{self.file}:{self.line} {self.name} {self.how}"


def is_environ(node: ast.AST, aliases: Aliases = Aliases()) -> bool:
    """Whether ``node`` is ``os.environ`` (under the module's ``aliases``)."""
    if isinstance(node, ast.Name):
        return node.id in aliases.environ
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id in aliases.os)


def written(node: ast.AST, aliases: Aliases = Aliases()) -> list[tuple[ast.expr | None, str]]:
    """What ``node`` itself writes to the environment: for each variable,
    the expression that names it (None: any variable) and how."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        how = "delete" if isinstance(node, ast.Delete) else "set"
        return [(target.slice, how) for target in _targets(node.targets)
                if isinstance(target, ast.Subscript) and is_environ(target.value, aliases)]
    if isinstance(node, ast.AugAssign):
        if isinstance(node.target, ast.Subscript) and is_environ(node.target.value, aliases):
            return [(node.target.slice, "set")]
        if is_environ(node.target, aliases) and isinstance(node.op, ast.BitOr):
            return _mapping_keys(node.value, "update")
        return []
    if not isinstance(node, ast.Call):
        return []
    function = _written_by(node.func, aliases)
    if function is None:
        return []
    how = WRITING_METHODS.get(function) or OS_FUNCTIONS.get(function) or HELPERS[function]
    if function in _TAKES_NOTHING:
        return [(None, how)]
    if function in _TAKES_MAPPING:
        written_keys = _mapping_keys(node.args[0], how) if node.args else []
        return written_keys + [(ast.Constant(keyword.arg), how) if keyword.arg
                               else (ast.Dict([None], [keyword.value]), how)
                               for keyword in node.keywords]
    return [(node.args[0], how)] if node.args else []


def writes(node: ast.AST, aliases: Aliases = Aliases()) -> bool:
    """Whether ``node`` itself writes to the environment."""
    return bool(written(node, aliases))


def environment_writes(path: Path, root: Path) -> list[EnvironmentWrite]:
    """Every environment variable the Python source file ``path`` writes,
    pops, deletes or defaults, in the order of the source, named relative
    to ``root``; ``root`` is also where a constant imported by an absolute
    import is looked for (``root/vllm/utils/torch_utils.py`` for
    ``vllm.utils.torch_utils``)."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = Aliases.of(tree)
    label = path.relative_to(root).as_posix()
    found = []
    for node, scopes in _scoped(tree, ()):
        function = next((scope for scope in reversed(scopes) if isinstance(scope, Function)),
                        None)
        for expression, how in written(node, aliases):
            names = ([EVERY_NAME] if expression is None
                     else _names(expression, function, path, root, frozenset()))
            found += [EnvironmentWrite(label, node.lineno, name, how,
                                       ".".join(scope.name for scope in scopes))
                      for name in names]
    return found


def _targets(targets: list[ast.expr]) -> Iterator[ast.expr]:
    """Each target of an assignment or ``del``, unpacked."""
    for target in targets:
        if isinstance(target, (ast.Tuple, ast.List)):
            yield from _targets(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _targets([target.value])
        else:
            yield target


def _written_by(function: ast.expr, aliases: Aliases) -> str | None:
    """Which writing function a call of ``function`` is (None: none)."""
    if isinstance(function, ast.Name):
        return aliases.functions.get(function.id)
    if not isinstance(function, ast.Attribute):
        return None
    if is_environ(function.value, aliases):
        return function.attr if function.attr in WRITING_METHODS else None
    if isinstance(function.value, ast.Name) and function.value.id in aliases.os:
        return function.attr if function.attr in OS_FUNCTIONS else None
    # a helper called through its module (``system_utils.set_env_var``)
    return function.attr if function.attr in HELPERS else None


def _mapping_keys(mapping: ast.expr, how: str) -> list[tuple[ast.expr | None, str]]:
    """The names a write of ``mapping`` sets: a dict literal's keys (a
    ``**`` entry as itself), any other expression as itself."""
    if not isinstance(mapping, ast.Dict):
        return [(mapping, how)]
    return [(key if key is not None else ast.Dict([None], [value]), how)
            for key, value in zip(mapping.keys, mapping.values, strict=True)]


def _scoped(node: ast.AST, scopes: tuple[Scope, ...]
            ) -> Iterator[tuple[ast.AST, tuple[Scope, ...]]]:
    """Every node under ``node`` with the classes and functions around it."""
    for child in ast.iter_child_nodes(node):
        yield child, scopes
        yield from _scoped(child, scopes + (child,) if isinstance(child, Scope) else scopes)


def _names(expression: ast.expr, function: Function | None,
           path: Path, root: Path, seen: frozenset[str]) -> list[str]:
    """The variable names ``expression`` (in ``function`` of ``path``) may
    be: resolved (see the module's docstring), or ``?`` and its source.
    ``seen``: the local names being resolved already, which add nothing
    more where they come round again (``old[k] = ...`` in a loop over ``k``)."""
    unresolved = ["?" + ast.unparse(expression)]
    if isinstance(expression, ast.Constant) and isinstance(expression.value, str):
        return [expression.value]
    if not isinstance(expression, ast.Name):
        return unresolved
    if expression.id in seen:
        return []
    if function is not None and expression.id in _locals(function):
        keys = _loop_keys(expression.id, function, path, root, seen | {expression.id})
        return unresolved if keys is None else keys
    constant = _constant(expression.id, path, root, frozenset())
    return unresolved if constant is None else [constant]


def _locals(function: Function) -> set[str]:
    """The names ``function`` binds: its parameters and what it assigns."""
    arguments = function.args
    names = {argument.arg for argument in arguments.posonlyargs + arguments.args
             + arguments.kwonlyargs}
    names |= {argument.arg for argument in (arguments.vararg, arguments.kwarg) if argument}
    return names | {node.id for node in ast.walk(function)
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}


def _loop_keys(name: str, function: Function, path: Path,
               root: Path, seen: frozenset[str]) -> list[str] | None:
    """The names ``name`` takes in ``function``, where it is bound only as
    the (first) target of loops over dicts the function builds itself
    (``for k in d``, ``d.keys()``, ``d.items()``); None otherwise."""
    keys: list[str] = []
    for node in ast.walk(function):
        bound = ((isinstance(node, ast.Name) and node.id == name
                  and isinstance(node.ctx, ast.Store)) or isinstance(node, ast.arg)
                 and node.arg == name)
        if not bound:
            continue
        loop = next((loop for loop in ast.walk(function) if isinstance(loop, ast.For)
                     and node in (loop.target, *getattr(loop.target, "elts", ())[:1])), None)
        if loop is None:
            return None
        iterated = loop.iter
        if (isinstance(iterated, ast.Call) and isinstance(iterated.func, ast.Attribute)
                and iterated.func.attr in ("keys", "items") and not iterated.args):
            iterated = iterated.func.value
        if not isinstance(iterated, ast.Name):
            return None
        dict_keys = _dict_keys(iterated.id, function, path, root, seen)
        if dict_keys is None:
            return None
        keys += [key for key in dict_keys if key not in keys]
    return keys


def _dict_keys(name: str, function: Function, path: Path,
               root: Path, seen: frozenset[str]) -> list[str] | None:
    """Every key the dict ``name`` of ``function`` may hold, where the
    function builds it (``{}`` or a dict literal, then ``d[key] = ...``)
    and otherwise only reads it; None where that cannot be told."""
    parents = {child: parent for parent in ast.walk(function)
               for child in ast.iter_child_nodes(parent)}
    keys: list[str] = []
    for node in ast.walk(function):
        if isinstance(node, ast.arg) and node.arg == name:
            return None  # the caller's dict
        if not (isinstance(node, ast.Name) and node.id == name):
            continue
        parent = parents[node]
        if isinstance(node.ctx, ast.Store):
            if not (isinstance(parent, ast.Assign) and parent.targets == [node]
                    and isinstance(parent.value, ast.Dict) and None not in parent.value.keys):
                return None
            added = [key for key in parent.value.keys if key is not None]
        elif isinstance(parent, ast.Subscript) and isinstance(parent.ctx, ast.Store):
            added = [parent.slice]
        elif (isinstance(parent, ast.Subscript) or isinstance(parent, ast.For)
              and parent.iter is node or isinstance(parent, ast.Compare)
              or isinstance(parent, ast.Attribute) and parent.attr in _READING_METHODS):
            continue
        else:
            return None  # passed on or changed in a way not followed
        for key in added:
            resolved = _names(key, function, path, root, seen)
            if any(found.startswith("?") for found in resolved):
                return None
            keys += [found for found in resolved if found not in keys]
    return keys


def _constant(name: str, path: Path, root: Path,
              followed: frozenset[tuple[Path, str]]) -> str | None:
    """The string module ``path`` binds ``name`` to at its top level:
    a string literal (one value, however often assigned), or a constant
    imported by name from a module found under ``root``; None otherwise.
    ``followed``: the imports followed so far (a cycle resolves nothing)."""
    literals, imports = _module_names(path, root)
    if name in literals:
        return literals[name]
    if name not in imports or (path, name) in followed:
        return None
    source, original = imports[name]
    return _constant(original, source, root, followed | {(path, name)})


@cache
def _module_names(path: Path, root: Path
                  ) -> tuple[dict[str, str], dict[str, tuple[Path, str]]]:
    """What module ``path`` binds to strings at its top level, and what it
    imports by name from modules under ``root`` (local name -> file, name there)."""
    tree = ast.parse(path.read_text(), str(path))
    values: dict[str, set[object]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            literal = value.value if isinstance(value, ast.Constant) else value
            values.setdefault(target.id, set()).add(literal)
    literals = {name: value for name, (value, *more) in values.items()
                if isinstance(value, str) and not more}
    imports = {}
    for node in ast.walk(tree):
        source = _module_file(node, path, root) if isinstance(node, ast.ImportFrom) else None
        if source is not None:
            imports |= {alias.asname or alias.name: (source, alias.name) for alias in node.names}
    return literals, imports


def _module_file(node: ast.ImportFrom, path: Path, root: Path) -> Path | None:
    """The file of the module ``node`` (in ``path``) imports from, if it is under ``root``."""
    base = root if node.level == 0 else path.parents[node.level - 1]
    folder = base.joinpath(*node.module.split(".")) if node.module else base
    for candidate in (folder.with_suffix(".py"), folder / "__init__.py"):
        if candidate.is_file() and candidate.resolve() != path.resolve():
            return candidate
    return None
