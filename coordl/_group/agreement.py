"""Descriptions of transforms, collate functions and DALI pipeline functions that hold across processes.

hp_group members must agree on these, so each is described by a readable label and a digest of
everything that defines it:

- a function: its code (bytecode, constants, names, nested functions), defaults, keyword defaults,
  closure cells, and the plain values (numbers, strings) of the globals it names;
- a ``functools.partial`` or a bound method: its function and what is bound to it;
- a tensor: its dtype, shape and bytes;
- any other object: what pickling it would save (``__reduce_ex__``: its type and state, such as
  ``__dict__``), described the same way.

No part depends on memory addresses or string hashing, so equal objects get equal descriptions in
every process. What cannot be pickled (a lock, an open file) cannot be described and is refused.
Classes are named, not described: a method's code, or a function a function calls, is not compared.
"""

import functools
import hashlib
import pickle
import re
import types

import torch

MAX_DEPTH = 64
"""Nesting beyond which an object is refused rather than described."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_PLAIN = (type(None), bool, int, float, complex, str)
_SHOWN_LEN = 80


class _NotComparable(Exception):
    """A part of the described object (named by its path) has no description that holds across processes."""

    def __init__(self, path: str, why: str):
        super().__init__(f"{path} {why}")


def describe(obj, setting: str) -> str:
    """``obj``'s label and a digest of what defines it: the same in every process for objects defined alike.

    Args:
        obj: a transform, collate function or DALI pipeline function.
        setting: the keyword it was given as (e.g. ``"transform"``), for errors.

    Raises:
        ValueError: if a part of ``obj`` cannot be described (it cannot be pickled, or it nests deeper
            than ``MAX_DEPTH``), naming the setting, the part and ``hp_group_key=``.
    """
    try:
        text = _canon(obj, setting, depth=0, ancestors=())
    except _NotComparable as e:
        shown = label(obj)
        shown = shown if len(shown) <= _SHOWN_LEN else f"{shown[:_SHOWN_LEN]}..."
        raise ValueError(f"hp_group cannot compare {setting}={shown}: {e}, so jobs that differ in it cannot "
                         f"be told apart. Pass hp_group_key= a name for these settings instead (jobs with equal "
                         f"keys share batches)") from None
    return f"{label(obj)} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"


def label(obj) -> str:
    """A readable name on one line: a function's or class's qualified name, else the repr without memory
    addresses."""
    if isinstance(obj, (types.FunctionType, type)):
        return _qualname(obj)
    return " ".join(_ADDRESS.sub("", repr(obj)).split())


def _qualname(obj) -> str:
    return f"{getattr(obj, '__module__', None)}.{obj.__qualname__}"


def _canon(obj, path: str, depth: int, ancestors: tuple) -> str:
    """The canonical text of ``obj``, found at ``path`` inside the described object."""
    if isinstance(obj, _PLAIN):
        return f"{type(obj).__qualname__} {obj!r}"
    if isinstance(obj, (bytes, bytearray)):
        return f"{type(obj).__qualname__} {len(obj)} {hashlib.sha256(obj).hexdigest()}"
    if depth > MAX_DEPTH:
        raise _NotComparable(path, f"nests deeper than {MAX_DEPTH} levels")
    for level, ancestor in enumerate(ancestors):
        if ancestor is obj:
            return f"cycle to level {level}"
    inner = functools.partial(_canon, depth=depth + 1, ancestors=(*ancestors, obj))
    for kind, canon in _KINDS:
        if isinstance(obj, kind):
            return canon(obj, path, inner)
    return _reduced(obj, path, inner)


def _sequence(seq, path, inner) -> str:
    return f"{type(seq).__qualname__} [{', '.join(inner(item, f'{path}[{i}]') for i, item in enumerate(seq))}]"


def _set(items, path, inner) -> str:
    return f"{type(items).__qualname__} {{{', '.join(sorted(inner(item, f'{path} item') for item in items))}}}"


def _dict(mapping, path, inner) -> str:
    return f"dict {_items(mapping, lambda key: f'{path}[{key!r}]', inner)}"


def _items(mapping, path_of, inner) -> str:
    """Key-value pairs in sorted order: insertion order may come from a set, which varies between processes."""
    pairs = sorted(f"{inner(key, path_of(key))}: {inner(value, path_of(key))}" for key, value in mapping.items())
    return f"{{{', '.join(pairs)}}}"


def _function(fn, path, inner) -> str:
    code = fn.__code__
    cells = ", ".join(f"{name}={_cell(cell, f'{path}.<closure {name}>', inner)}"
                      for name, cell in zip(code.co_freevars, fn.__closure__ or ()))
    plain = {name: fn.__globals__[name] for name in _global_names(code)
             if name in fn.__globals__ and isinstance(fn.__globals__[name], (*_PLAIN, bytes))}
    return (f"function {_qualname(fn)} {inner(code, path)} defaults {inner(fn.__defaults__, f'{path}.__defaults__')} "
            f"kwdefaults {inner(fn.__kwdefaults__, f'{path}.__kwdefaults__')} closure [{cells}] "
            f"globals {inner(plain, f'{path}.<globals>')}")


def _cell(cell, path, inner) -> str:
    try:
        contents = cell.cell_contents
    except ValueError:  # a variable not yet assigned
        return "empty"
    return inner(contents, path)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _code(code, path, inner) -> str:
    """Bytecode, constants (nested functions' code among them), names and signature; not line numbers."""
    shape = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    consts = ", ".join(inner(const, path) for const in code.co_consts)
    return f"code {hashlib.sha256(code.co_code).hexdigest()} {shape} names {code.co_names} consts [{consts}]"


def _method(method, path, inner) -> str:
    return f"method {inner(method.__func__, path)} of {inner(method.__self__, f'{path}.__self__')}"


def _builtin(fn, path, inner) -> str:
    owner = fn.__self__
    bound = "" if owner is None or isinstance(owner, types.ModuleType) else f" of {inner(owner, f'{path}.__self__')}"
    return f"builtin {fn.__module__}.{fn.__qualname__}{bound}"


def _partial(part, path, inner) -> str:
    return (f"partial {inner(part.func, f'{path}.func')} args {inner(part.args, f'{path}.args')} "
            f"keywords {inner(part.keywords, f'{path}.keywords')}")


def _tensor(tensor, path, inner) -> str:
    try:
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as e:
        raise _NotComparable(path, f"is a tensor whose bytes cannot be read ({e})") from None
    return f"{_qualname(type(tensor))} {tensor.dtype} {tuple(tensor.shape)} {hashlib.sha256(data).hexdigest()}"


def _reduced(obj, path, inner) -> str:
    """What pickling would save: how ``obj`` is rebuilt (type, arguments) and its state."""
    try:
        reduced = obj.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    except (TypeError, pickle.PicklingError) as e:
        raise _NotComparable(path, f"is {label(obj)}, which cannot be pickled ({e})") from None
    if isinstance(reduced, str):  # pickled by reference to a global of that name
        return f"global {getattr(obj, '__module__', None)}.{reduced}"
    rebuild, args, state, items, pairs = (*reduced, None, None, None)[:5]
    state_text = (_items(state, lambda name: f"{path}.{name}", inner) if isinstance(state, dict)
                  else inner(state, path))
    return (f"object {inner(rebuild, path)} {inner(args, path)} state {state_text}"
            f" items {inner(list(items or ()), path)} pairs {inner(list(pairs or ()), path)}")


_KINDS = (
    ((list, tuple), _sequence),
    ((set, frozenset), _set),
    (dict, _dict),
    (type, lambda cls, path, inner: f"class {_qualname(cls)}"),
    (types.ModuleType, lambda module, path, inner: f"module {module.__name__}"),
    (types.FunctionType, _function),
    (types.CodeType, _code),
    (types.MethodType, _method),
    (types.BuiltinFunctionType, _builtin),
    (functools.partial, _partial),
    (torch.Tensor, _tensor),
)
"""How each kind of object is described (first match); anything else by what pickling would save."""
