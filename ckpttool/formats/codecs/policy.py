"""The pickle policy: what a global named by a pickle *is* decides what happens to it, the same
for every reader (DCP ``.metadata`` and records, per-rank files, ``torch.save`` files,
DeepSpeed files, Megatron's ``common.pt``).

One table by kind (:data:`KINDS`, shown in docs/promises.md):

- **data**: a class that only builds inert data (an Enum member, a path, a namespace, a
  dataclass or NamedTuple, a container, a date, a number) is read through an inert stand-in
  that keeps the pickled values and runs nothing of the class;
- **runs code**: a callable that can run anything (``os.system``, ``eval``, ``subprocess``,
  ``builtins.getattr`` on anything but an Enum, ``functools.partial``, ``copyreg``...) makes
  the file "may be malicious" (exit 3);
- **unknown**: anything else is "not supported yet", naming the global and the file (exit 4).

Deciding what a global is never runs the file's code and never imports a module to find
out: a global is looked up (statically, in the module's ``__dict__``) only in a module that
is already imported (an Enum's members) or in :data:`_SAFE_TO_IMPORT` (standard modules
without import side effects: their enums, dataclasses and NamedTuples). A class from a
module that is not there (a writer's own enum, Megatron-Core's ``InferenceCudaGraphScope``
under another version) is read only in an Enum member's shape (``Class(value)`` with one
plain value, or Python 3.11's ``getattr(Class, "NAME")``): its value stands for it; any
other use of it is "unknown" (telling a third-party dataclass from a class that runs code
when unpickled would need its module imported, which runs that module's code).

A format's lookup names its own classes first (DCP's metadata, a DTensor's spec) and ends
with :func:`data_global`; a refused pickle gets its one line from :func:`refusal`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import pickle
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

from ckpttool.errors import InputError, UnsupportedError

DATA, RUNS_CODE, UNKNOWN = "data", "runs code", "unknown"


class Refused(Exception):
    """A pickle named a global outside the allow-list, or used an allowed one in a way only
    code would (``getattr`` of a non-member); nothing was looked up or run."""

    def __init__(self, module: str, name: str) -> None:
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name
        self.qualname = f"{module}.{name}"


# --------------------------------------------------------------------------------------------
# Inert stand-ins


class Sealed(type):
    """The metaclass of the stand-in classes: one is shared by every pickle the process reads,
    so BUILD on the class itself (a pickle's ``(None, {'field': ...})`` slot state) must not
    set its attributes for the next file."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"a pickle set {name!r} on the class {cls.__name__}")

    def __delattr__(cls, name: str) -> None:
        raise pickle.UnpicklingError(f"a pickle deleted {name!r} of the class {cls.__name__}")


class Stub(metaclass=Sealed):
    """Stand-in for a class that pickle builds with NEWOBJ and BUILD (DCP's metadata classes,
    a DTensor's spec and mesh, a namespace, a dataclass): keeps the state pickle hands it,
    runs nothing."""

    state: Any = None  # NEWOBJ does not call __init__; BUILD may never come

    def __init__(self, *args: Any) -> None:
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        state = self.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots) state
        if isinstance(state, dict):
            return state.get(name, default)
        return default


def stub_class(name: str) -> type[Stub]:
    """A distinct :class:`Stub` subclass named like the class it stands for."""
    return type(name, (Stub,), {})


class PlainStub(metaclass=Sealed):
    """Stand-in for a dataclass whose pickled state is a dict (DCP's metadata classes but
    ``TensorProperties``). Without ``__init__`` or ``__setstate__``, NEWOBJ and BUILD run in
    the C unpickler alone: no Python frame per object, which is what a ``.metadata`` of
    millions of chunks costs. A state that is not a dict fails to unpickle (corrupt)."""

    def field(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)


def plain_stub_class(name: str) -> type[PlainStub]:
    """A distinct :class:`PlainStub` subclass named like the class it stands for."""
    return type(name, (PlainStub,), {})


class Namespace(dict):  # type: ignore[type-arg]
    """``argparse.Namespace`` or ``types.SimpleNamespace`` (Megatron-LM's ``args``): its
    attributes as a dict (NEWOBJ or a call without arguments, then BUILD with them)."""

    def __init__(self, *args: Any) -> None:
        if args:
            raise pickle.UnpicklingError("a namespace built other than empty")
        super().__init__()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise pickle.UnpicklingError("a namespace whose attributes are not a dict")
        self.update(state)


class Fields(tuple, metaclass=Sealed):  # type: ignore[type-arg]
    """Stand-in for a NamedTuple pickle builds with NEWOBJ or a call (its fields in order)."""

    def __new__(cls, *fields: Any) -> Fields:
        return tuple.__new__(cls, fields)


def fields_class(name: str) -> type[Fields]:
    """A distinct :class:`Fields` subclass named like the NamedTuple it stands for."""
    return type(name, (Fields,), {})


_PLAIN_VALUES = (int, str, float, bool, bytes, type(None))


class EnumClass:
    """Stand-in for an ``enum.Enum`` class: its real member names and values; a member reads
    as its value.

    Most Pythons pickle a member by value, ``Class(value)``, which calls this; Python 3.11.0 to
    3.11.x (Debian 12's system ``python3``) pickles it by name, ``getattr(Class, 'NAME')``,
    which :func:`enum_getattr` answers. Either way only these members are reached: the value
    stands for the member, nothing of the real class is looked up.
    """

    __slots__ = ("qualname", "members", "flag")

    def __init__(self, qualname: str, members: dict[str, Any], *, flag: bool = False) -> None:
        self.qualname = qualname
        self.members = dict(members)  # name -> value, as the real class defines them
        self.flag = flag  # a Flag: any combination of its members' bits is a value

    def __call__(self, value: Any) -> Any:
        if type(value) in _PLAIN_VALUES:
            if any(type(v) is type(value) and v == value for v in self.members.values()):
                return value
            if self.flag and type(value) is int and value >= 0:
                bits = functools.reduce(lambda a, b: a | b, (v for v in self.members.values()
                                                             if type(v) is int), 0)
                if value & ~bits == 0:
                    return value
        raise pickle.UnpicklingError(f"{value!r:.40} is not a member of {self.qualname}")

    def __setstate__(self, state: Any) -> None:
        # BUILD on this shared stand-in (cached per class) would change its members for the
        # rest of the process.
        raise pickle.UnpicklingError(f"a pickle set the state of the enum {self.qualname}")

    def __repr__(self) -> str:
        return self.qualname


class UnresolvedClass(metaclass=Sealed):
    """Base of the stand-in for a class whose module is not here (or lacks it): read only in
    an Enum member's shape, ``Class(value)`` with one plain value (NEWOBJ and REDUCE both
    come through ``__new__``), or ``getattr(Class, 'NAME')``; anything else is refused, so
    that the file is "not supported yet", naming the class."""

    module: str = ""
    name: str = ""

    def __new__(cls, *args: Any) -> Any:  # noqa: D102 - returns the value, never an instance
        if len(args) == 1 and type(args[0]) in (int, str):
            return args[0]
        raise Refused(cls.module, cls.name)


@functools.lru_cache(maxsize=256)
def unresolved_class(module: str, name: str) -> type[UnresolvedClass]:
    """The :class:`UnresolvedClass` standing for ``module.name``."""
    return type(name.rsplit(".", 1)[-1], (UnresolvedClass,), {"module": module, "name": name})


def enum_getattr(obj: Any, name: Any) -> Any:
    """``builtins.getattr`` as Python 3.11 pickles an Enum member: allowed exactly for an
    :class:`EnumClass` and one of its real member names (its value), or for an
    :class:`UnresolvedClass` and a public name (the name, its value being unknown here).

    Raises:
        Refused: anything else (another object, another name, a dunder); nothing is looked up.
    """
    if isinstance(obj, EnumClass) and type(name) is str and name in obj.members:
        return obj.members[name]
    if isinstance(obj, type) and issubclass(obj, UnresolvedClass) and type(name) is str and \
            name.isidentifier() and not name.startswith("_"):
        return name
    # Named as the pickle names it: the stand-in's class name, else the value's type.
    what = (obj.qualname if isinstance(obj, EnumClass)
            else obj.__name__ if isinstance(obj, type) else type(obj).__name__)
    raise Refused("builtins", f"getattr({what}, {str(name)[:60]!r})")


def path_of(*parts: Any) -> str:
    """A ``pathlib`` path (pickled as its class and its parts) as its text."""
    if not all(type(p) is str for p in parts):
        raise pickle.UnpicklingError("a path pickled other than as strings")
    import pathlib  # a pure-string class: builds the text, touches no file

    return str(pathlib.PurePosixPath(*parts))


def _windows_path(*parts: Any) -> str:
    path_of(*parts)  # the same checks
    import pathlib

    return str(pathlib.PureWindowsPath(*parts))


class _OrderedDict(dict):  # type: ignore[type-arg]
    """``collections.OrderedDict`` as pickled by ``state_dict()``: a dict whose BUILD state
    (the ``_metadata`` attribute with module versions) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


def _defaultdict(factory: Any = None, *_: Any) -> dict[Any, Any]:
    """``collections.defaultdict``: its items (SETITEMS) without the factory (never called)."""
    return {}


def _deque(items: Any = (), maxlen: Any = None) -> list[Any]:
    if not isinstance(items, (list, tuple)) or not (maxlen is None or type(maxlen) is int):
        raise pickle.UnpicklingError("deque() called other than with items")
    return list(items)


def _counter(items: Any = None) -> dict[Any, Any]:
    if items is not None and not isinstance(items, dict):
        raise pickle.UnpicklingError("Counter() called other than with a dict")
    return dict(items or {})


# The plain values torch.load(weights_only=True) builds from builtins (set, bytearray,
# complex), and two it refuses although they are as inert: an empty bytes value (protocol 2
# pickles b"" as bytes()) and a frozenset. Each checks its arguments, so that a pickle cannot
# make them allocate what it likes (bytearray(10**12)).
def _bytes(*args: Any) -> bytes:
    if args:
        raise pickle.UnpicklingError("bytes() called other than for an empty value")
    return b""


def _bytearray(data: Any = b"") -> bytearray:
    if not isinstance(data, (bytes, bytearray)):
        raise pickle.UnpicklingError("bytearray() called other than with bytes")
    return bytearray(data)


def _set(items: Any = ()) -> set[Any]:
    if not isinstance(items, (list, tuple)):
        raise pickle.UnpicklingError("set() called other than with a list")
    return set(items)


def _frozenset(items: Any = ()) -> frozenset[Any]:
    return frozenset(_set(items))


def _complex(real: Any = 0.0, imag: Any = 0.0) -> complex:
    if not all(type(v) in (int, float) for v in (real, imag)):
        raise pickle.UnpicklingError("complex() called other than with numbers")
    return complex(real, imag)


def _encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as a pickle of ``bytes`` calls it (latin-1 of a str): the one use
    ``torch.load(weights_only=True)`` allows; anything else is corrupt."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode called other than for bytes")
    return text.encode("latin-1")


def _fraction(*args: Any) -> Any:
    """``fractions.Fraction`` (a Python class: handed to a pickle, BUILD could set its
    attributes for the whole process), built from what its pickle passes: text or ints."""
    if not (1 <= len(args) <= 2 and all(type(a) is int for a in args)) and not (
            len(args) == 1 and type(args[0]) is str and len(args[0]) <= 4096):
        raise pickle.UnpicklingError("Fraction() called other than with text or integers")
    import fractions

    return fractions.Fraction(*args)


def _real(module: str, name: str) -> Callable[[], Any]:
    """The real class, for C types that only build a value from plain ones (datetime...)."""
    return lambda: getattr(importlib.import_module(module), name)


_PATHS = ("Path", "PosixPath", "PurePath", "PurePosixPath")
_WINDOWS_PATHS = ("WindowsPath", "PureWindowsPath")

# data: (module, name) -> a factory of its stand-in. The stand-ins for enums and for the
# classes found in imported modules are made by _resolved().
_DATA: dict[tuple[str, str], Callable[[], Any]] = {
    # pathlib under every Python: 3.13 pickles pathlib._local.PosixPath.
    **{(m, n): (lambda: path_of) for m in ("pathlib", "pathlib._local") for n in _PATHS},
    **{(m, n): (lambda: _windows_path) for m in ("pathlib", "pathlib._local")
       for n in _WINDOWS_PATHS},
    ("argparse", "Namespace"): lambda: Namespace,
    ("types", "SimpleNamespace"): lambda: Namespace,
    ("collections", "OrderedDict"): lambda: _OrderedDict,
    ("collections", "defaultdict"): lambda: _defaultdict,
    ("collections", "deque"): lambda: _deque,
    ("collections", "Counter"): lambda: _counter,
    ("_codecs", "encode"): lambda: _encode,  # how protocol 2 pickles bytes
    **{("datetime", n): _real("datetime", n)
       for n in ("datetime", "date", "time", "timedelta", "timezone")},
    ("decimal", "Decimal"): _real("decimal", "Decimal"),
    ("fractions", "Fraction"): lambda: _fraction,
    ("uuid", "UUID"): _real("uuid", "UUID"),
    ("torch.torch_version", "TorchVersion"): lambda: str,
    **{(m, n): (lambda f=f: f) for m in ("builtins", "__builtin__")  # type: ignore[misc]
       for n, f in (("bytes", _bytes), ("bytearray", _bytearray), ("set", _set),
                    ("frozenset", _frozenset), ("complex", _complex))},
    # Standard enums (signal.SIGTERM in Megatron-LM's args): read from the real class.
    **{(m, n): (lambda m=m, n=n: _resolved(m, n)) for m, n in (  # type: ignore[misc]
        ("signal", "Signals"), ("signal", "Handlers"), ("signal", "Sigmasks"),
        ("http", "HTTPStatus"), ("re", "RegexFlag"), ("socket", "AddressFamily"),
        ("socket", "SocketKind"), ("inspect", "_ParameterKind"))},
}

# runs code: every name in these modules (and their submodules) but the data ones above:
# process, file, import, network, interpreter and pickle machinery.
_RUNS_CODE_MODULES = frozenset({
    "os", "posix", "nt", "posixpath", "ntpath", "subprocess", "_posixsubprocess", "sys",
    "builtins", "__builtin__", "importlib", "imp", "runpy", "pkgutil", "zipimport", "site",
    "ctypes", "_ctypes", "cffi", "shutil", "socket", "_socket", "ssl", "pty", "tty", "code",
    "codeop", "pickle", "_pickle", "cPickle", "pickletools", "marshal", "dill", "cloudpickle",
    "types", "operator", "_operator", "functools", "_functools", "copyreg", "copy_reg",
    "copy", "webbrowser", "multiprocessing", "_multiprocessing", "threading", "_thread",
    "asyncio", "concurrent", "io", "_io", "codecs", "tempfile", "glob", "fileinput",
    "linecache", "pdb", "bdb", "timeit", "trace", "cProfile", "profile", "doctest", "unittest",
    "sysconfig", "distutils", "setuptools", "pip", "ensurepip", "venv", "gc", "atexit",
    "mmap", "fcntl", "resource", "select", "selectors", "signal", "_signal", "http",
    "urllib", "urllib2", "ftplib", "smtplib", "telnetlib", "xmlrpc", "socketserver",
    "logging", "pydoc", "idlelib", "platform", "commands", "popen2", "zipfile", "tarfile",
    "shelve", "dbm", "sqlite3", "inspect", "traceback", "warnings", "weakref", "ast",
    "dis", "tokenize", "string", "re", "getpass", "uuid", "collections", "argparse",
    "pathlib", "enum", "dataclasses", "_codecs", "torch._C",
    "numpy.testing", "numpy.f2py", "numpy.distutils", "numpy.lib.npyio", "torch.hub",
    "torch.jit", "torch.package", "torch.utils.cpp_extension", "torch._dynamo", "torch.ops",
    "torch.classes", "torch._ops", "torch.cuda", "torch.multiprocessing",
})
# runs code: single callables elsewhere (loaders that unpickle again, code execution).
_RUNS_CODE_NAMES = frozenset({
    ("torch", "load"), ("torch", "save"), ("torch.serialization", "load"),
    ("torch.serialization", "_load"), ("torch.storage", "_load_from_bytes"),
    ("torch._utils", "_rebuild_from_type"), ("torch", "compile"),
    ("numpy", "load"), ("numpy", "loadtxt"), ("numpy", "fromfile"), ("numpy", "genfromtxt"),
    ("numpy", "save"), ("numpy", "savetxt"), ("numpy", "memmap"), ("numpy", "frompyfunc"),
    ("numpy", "vectorize"),
    # torch's own that exec() the text the pickle gives them (torch._tensor's
    # _rebuild_from_type_v2 is not here: any tensor with attributes pickles through it)
    *(("torch.fx.graph_module", n) for n in (
        "reduce_graph_module", "reduce_package_graph_module", "reduce_deploy_graph_module",
        "_forward_from_src", "_exec_with_source", "_deserialize_graph_module")),
})

# Modules imported (when not yet) to see what one of their globals is: standard modules
# whose import runs nothing but their own definitions.
_SAFE_TO_IMPORT = frozenset({"enum", "signal", "http", "re", "socket", "inspect",
                             "argparse", "pathlib", "datetime", "decimal", "fractions",
                             "uuid", "ipaddress", "dataclasses", "collections"})

# What each kind is and what happens to it: the table docs/promises.md shows.
KINDS: tuple[tuple[str, str, str], ...] = (
    (DATA, "Enum, IntEnum and Flag members (signal.Signals too), pathlib paths (pathlib._local "
     "on 3.13), argparse.Namespace, types.SimpleNamespace, dataclasses and NamedTuples, "
     "collections' containers, datetime values, Decimal, Fraction, UUID, numpy arrays, "
     "tensors and their torch classes", "read, as an inert stand-in holding the values"),
    (RUNS_CODE, "os, subprocess, sys, builtins (eval, exec, getattr on anything but an Enum, "
     "__import__, open...), importlib, functools.partial, operator, copyreg, pickle, "
     "marshal, types, ctypes, shutil, socket, torch.load, numpy.load and the other modules "
     "listed in formats/codecs/policy.py", "exit 3: the file may be malicious"),
    (RUNS_CODE, "a function of a module already imported (torch's own aside)",
     "exit 3: the file may be malicious"),
    (UNKNOWN, "any other global (a class or function of a module that is not imported, "
     "torch's functions it does not read)",
     "exit 4: not supported yet, naming the global and the file"),
)


def _top_modules(module: str) -> Iterable[str]:
    parts = module.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts) + 1))


def can_run_anything(module: str, name: str) -> bool:
    """``module.name`` can run code: a runs-code module (or a submodule of one) and not one
    of the data globals, or a runs-code callable."""
    if (module, name) in _DATA or (module, name) in _RUNS_CODE_NAMES:
        return (module, name) in _RUNS_CODE_NAMES
    if name.startswith("__") and name.endswith("__"):
        return True  # __reduce__, __import__, __builtins__...
    if any(part in _RUNS_CODE_MODULES for part in name.split(".")[:-1]):
        return True  # a module reached through another's namespace ("torch" "os.system")
    return any(m in _RUNS_CODE_MODULES for m in _top_modules(module))


_MISSING = object()


def _static(module: str, name: str) -> Any:
    """``module.name`` from the module's and classes' ``__dict__`` (no ``__getattr__``, no
    descriptor runs), in a module already imported or safe to import; else :data:`_MISSING`."""
    mod = sys.modules.get(module)
    if mod is None and module in _SAFE_TO_IMPORT:
        mod = importlib.import_module(module)
    if mod is None or "<" in name:
        return _MISSING
    obj: Any = mod
    for part in name.split("."):
        space = vars(obj) if not isinstance(obj, type) else next(
            (vars(c) for c in obj.__mro__ if part in vars(c)), {})
        obj = space.get(part, _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _enum_member(module: str, name: str) -> Any:
    """The value of an Enum member a module names at its top (Python 3.10 pickles
    ``signal.SIGTERM`` so: ``signal`` exports its members), else :data:`_MISSING`."""
    if "." in name:
        return _MISSING
    obj = _static(module, name)
    if isinstance(obj, enum.Enum) and type(obj.value) in _PLAIN_VALUES:
        return obj.value
    return _MISSING


def _inert_class(cls: type) -> bool:
    """A class whose pickle is its plain state: no ``__reduce__``, ``__reduce_ex__`` or
    ``__setstate__`` of its own (a stand-in replays the state; this says what it means)."""
    return not any(k in vars(c) for c in cls.__mro__[:-1]
                   for k in ("__reduce__", "__reduce_ex__", "__setstate__", "__getstate__"))


def _resolved(module: str, name: str) -> Any | None:
    """The stand-in for what ``module.name`` is, found without running anything of the file
    (see :func:`_static`), or None when it is no data class."""
    obj = _static(module, name)
    if not isinstance(obj, type):
        return None
    qualname = name.rsplit(".", 1)[-1]
    if issubclass(obj, enum.Enum):
        members = {k: m.value for k, m in obj.__members__.items()}
        if not all(type(v) in _PLAIN_VALUES for v in members.values()):
            return None
        return EnumClass(qualname, members, flag=issubclass(obj, enum.Flag))
    # A dataclass or NamedTuple only from a module looked at in full (not just because
    # something imported it): else reading would depend on what the process imported first.
    if module not in _SAFE_TO_IMPORT:
        return None
    if dataclasses.is_dataclass(obj) and _inert_class(obj):
        return stub_class(qualname)
    if issubclass(obj, tuple) and isinstance(vars(obj).get("_fields"), tuple):
        return fields_class(qualname)  # a NamedTuple
    return None


@functools.lru_cache(maxsize=1024)
def data_global(module: str, name: str) -> Any | None:
    """The inert stand-in for a data global (see the module's table), or None: it runs code
    or is unknown. The last step of every format's lookup."""
    if (module, name) in _DATA:
        return _DATA[(module, name)]()
    member = _enum_member(module, name)
    if member is not _MISSING:
        return member
    if can_run_anything(module, name):
        return None
    found = _resolved(module, name)
    if found is not None:
        return found
    last = name.rsplit(".", 1)[-1]
    if _static(module, name) is _MISSING and last[:1].isupper() and last.isidentifier():
        return unresolved_class(module, name)  # an Enum member's shape only
    return None


def kind(module: str, name: str) -> str:
    """:data:`DATA`, :data:`RUNS_CODE` or :data:`UNKNOWN` for ``module.name``."""
    if module in ("builtins", "__builtin__") and name.startswith("getattr("):
        return RUNS_CODE  # a getattr the Enum rule refused (Refused's name says on what)
    if (module, name) in _DATA:
        return DATA  # what the table reads (``_codecs.encode``: a builtin function, as data)
    if _enum_member(module, name) is not _MISSING:
        return DATA
    if can_run_anything(module, name):
        return RUNS_CODE
    obj = _static(module, name)
    if callable(obj) and not isinstance(obj, type) and module.split(".")[0] != "torch":
        return RUNS_CODE  # a function: calling it runs its code (torch's own: not yet read)
    found = data_global(module, name)
    if found is None or (isinstance(found, type) and issubclass(found, UnresolvedClass)):
        home = _home(obj)  # a dotted name reaching elsewhere ("torch" "os.system")
        return RUNS_CODE if home is not None and can_run_anything(*home) else UNKNOWN
    return DATA


def _home(obj: Any) -> tuple[str, str] | None:
    """Where a class or function found by :func:`_static` is defined, as a pickle of it would
    name it: a genuine pickle names that very place, a hostile one may reach it through
    another module's namespace."""
    if not isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if type(module) is not str or type(qualname) is not str:
        return None
    return module, qualname


# --------------------------------------------------------------------------------------------
# The verdict


def one_bit_from(refused: Refused, lookup: Callable[[str, str], Any | None]) -> str | None:
    """The global ``lookup`` allows that is one flipped bit away from the refused one (a
    damaged byte in a genuine checkpoint's class name), or None. Only looks names up."""
    for in_module, text in ((True, refused.module), (False, refused.name)):
        for i, char in enumerate(text):
            for bit in range(7):
                flipped = text[:i] + chr(ord(char) ^ (1 << bit)) + text[i + 1:]
                module, name = (flipped, refused.name) if in_module else (
                    refused.module, flipped)
                if can_run_anything(module, name):
                    continue
                try:
                    found = lookup(module, name)
                except Exception:  # noqa: BLE001 - a lookup that refuses by raising
                    found = None
                if found is not None and not (isinstance(found, type)
                                              and issubclass(found, UnresolvedClass)):
                    return f"{module}.{name}"
    return None


def refusal(where: object, refused: Refused, lookup: Callable[[str, str], Any | None],
            never: str, *, then: str = "", names: Iterable[tuple[str, str]] = ()
            ) -> InputError | UnsupportedError:
    """The one line for a refused pickle, by what its globals are: any that runs code (the
    refused one or any other the pickle names, ``names``: the first refused may be a decoy)
    makes the file "may be malicious" (exit 3); a class name one bit from an allowed one is
    damage (exit 3); else the file is valid but "not supported yet", naming the global
    (exit 4). ``never`` says what holds no such global ("a DCP .metadata never contains");
    ``then`` follows the malicious verdict."""
    others = [(m, n) for m, n in names if _refused_by(lookup, m, n)]
    bad = next((f"{m}.{n}" for m, n in [(refused.module, refused.name), *others]
                if kind(m, n) == RUNS_CODE), None)
    if bad is not None:
        return InputError(
            f"{where}: refused to load: the pickle asks for '{bad}', which {never}; "
            f"the file may be malicious (nothing was executed){then}")
    if not all(p.isidentifier() for p in (*refused.module.split("."), *refused.name.split("."))):
        return InputError(
            f"{where}: the pickle asks for {refused.qualname!r}, which is no Python name (no "
            "writer pickles one): the file is damaged (or was altered); nothing was executed. "
            "Copy it again from the source")
    near = one_bit_from(refused, lookup)
    if near is not None:
        return InputError(
            f"{where}: the pickle asks for '{refused.qualname}', one bit away from '{near}', "
            "which genuine checkpoints hold: the file is damaged (or was altered); nothing was "
            "executed. Copy it again from the source")
    return UnsupportedError(
        f"{where}: the pickle asks for '{refused.qualname}', a class or function ckpttool "
        "does not read (not supported yet; nothing was executed). Save the checkpoint "
        "without it, or report it with the writer's name and version")


def _refused_by(lookup: Callable[[str, str], Any | None], module: str, name: str) -> bool:
    try:
        return lookup(module, name) is None
    except Exception:  # noqa: BLE001 - a lookup that refuses by raising
        return True
