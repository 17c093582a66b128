"""Command-line flags made from config dataclasses: a flag's name, default, help and unit are written once,
in the metadata of the field it sets, and the config built from the parsed flags validates them.

A field becomes a flag when its metadata has "help". The other keys (all optional):

  flag          the flag's name (default: --field-name)
  choices, metavar, type   as in argparse; `type` parses the text (default: the field's own type)
  unit          "GiB" (the flag in GiB, the field in bytes) or "ms" (the flag in ms, the field in seconds)
  append        a repeatable flag, collected into the field's tuple
  flag_default  the flag's default where it differs from the field's (a command line's well-known port)
  group         the --help section; the fields of a nested config inherit the section of the field holding it

A bool field's flag is a switch that flips the field's default (`--enforce-eager`: cuda_graphs=False). A field
holding a config dataclass is walked for flags; an optional one (`X | None`) whose metadata has "help" is a
switch that builds it (`--planner`), else it stays None.

Several configs of one command may name the same flag (`--lease-s`: the router's and the workers'): one flag
then sets them all; their defaults and types must agree. It is listed (with its help) in the earliest of their
sections in the command's order. Old spellings of a flag (per command: `aliases`) are accepted, hidden from --help.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

GIB = 1 << 30
UNITS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "GiB": (lambda gib: int(gib * GIB), lambda size: size / GIB),  # (flag -> field, field -> flag)
    "ms": (lambda ms: ms / 1e3, lambda s: s * 1e3),
}
KEYS = frozenset({"help", "flag", "choices", "metavar", "type", "unit", "append", "flag_default", "group"})


@dataclasses.dataclass(frozen=True)
class Flag:
    """One flag and the config field it sets (`path`: dotted, from the root config)."""

    name: str
    path: str
    default: Any
    """The field's default, in the field's units."""
    kind: type
    """int, float, str or bool: what the text is parsed into (unless metadata gives a `type`)."""
    meta: Mapping[str, Any]
    group: str
    builds_config: bool = False
    """A switch that builds an optional nested config."""

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.kind is bool or self.builds_config

    @property
    def flag_default(self) -> Any:
        if "flag_default" in self.meta:
            return self.meta["flag_default"]
        if self.switch:
            return False
        if self.meta.get("append"):
            return list(self.default)
        unit = self.meta.get("unit")
        return UNITS[unit][1](self.default) if unit and self.default is not None else self.default

    def argparse_kwargs(self) -> dict[str, Any]:
        if self.switch:
            return {"dest": self.dest, "action": "store_true", "help": self.meta["help"]}
        shown = self.flag_default not in (None, []) and "default" not in self.meta["help"]
        kwargs = {"dest": self.dest, "help": self.meta["help"] + (" (default: %(default)s)" if shown else ""),
                  "type": self.meta.get("type", float if "unit" in self.meta else self.kind)}
        for key in ("choices", "metavar"):
            if key in self.meta:
                kwargs[key] = self.meta[key]
        if self.meta.get("append"):
            kwargs["action"] = "append"
        return kwargs

    def shares_with(self, other: Flag) -> bool:
        """Whether `other` (another field's flag of the same name) may be set by this one."""
        def spec(flag: Flag) -> tuple:
            return flag.flag_default, {k: v for k, v in flag.argparse_kwargs().items() if k != "help"}
        return spec(self) == spec(other)

    def value(self, args: argparse.Namespace) -> Any:
        """The field's value from the parsed flags."""
        given = getattr(args, self.dest)
        if self.builds_config:
            return True if given else None
        if self.kind is bool:
            return not self.default if given else self.default
        if given is None:
            return None
        if self.meta.get("append"):
            return tuple(given)
        unit = self.meta.get("unit")
        return UNITS[unit][0](given) if unit else given


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of `X`, `X | None` or `Optional[X]`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _kind(hint: Any) -> type:
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        return typing.get_args(hint)[0]
    return origin or hint


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"the flag of {f.name} needs a default")


def walk(cls: type, group: str, exclude: frozenset[str] = frozenset(), prefix: str = "") -> Iterator[Flag]:
    """Every flag that `cls`'s fields (and those of its nested configs) declare, skipping `exclude` paths."""
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        if path in exclude:
            continue
        unknown = set(f.metadata) - KEYS
        if unknown:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown flag metadata {sorted(unknown)}")
        base, optional = _unwrap(_hints(cls)[f.name])
        section = f.metadata.get("group", group)
        name = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        if dataclasses.is_dataclass(base):
            if "help" in f.metadata:
                if not optional:
                    raise TypeError(f"{cls.__name__}.{f.name}: only an optional config can be switched on")
                yield Flag(name, path, None, bool, f.metadata, section, builds_config=True)
            yield from walk(base, section, exclude, path + ".")
        elif "help" in f.metadata:
            yield Flag(name, path, _default(f), _kind(base), f.metadata, section)


def add_flag(parser: argparse._ActionsContainer, name: str, aliases: Sequence[str] = (), **kwargs: Any) -> None:
    """`parser.add_argument(name, **kwargs)`, plus `aliases` that set the same dest, hidden from --help."""
    action = parser.add_argument(name, **kwargs)
    for alias in aliases:
        parser.add_argument(alias, **{**kwargs, "dest": action.dest, "help": argparse.SUPPRESS,
                                      "default": argparse.SUPPRESS})


class ConfigFlags:
    """The flags one command takes for a root config class, and the config built from them."""

    def __init__(self, cls: type, group: str, exclude: Sequence[str] = (),
                 aliases: Mapping[str, Sequence[str]] | None = None, sections: Sequence[str] = ()) -> None:
        """`group`: the --help section of the root's own fields; `exclude`: field paths that get no flag
        (the command sets them); `aliases`: {flag: old spellings}; `sections`: the order of --help sections."""
        self.cls = cls
        self.exclude = frozenset(exclude)
        self.flags = list(walk(cls, group, self.exclude))
        self.aliases = dict(aliases or {})
        self.sections = list(sections)
        self.by_name: dict[str, Flag] = {}
        for flag in self.flags:
            first = self.by_name.setdefault(flag.name, flag)
            if not first.shares_with(flag):
                raise TypeError(f"{flag.name} sets {first.path} and {flag.path}, which disagree on it")
            if self._rank(flag) < self._rank(first):
                self.by_name[flag.name] = flag
        unknown = set(self.aliases) - set(self.by_name)
        if unknown:
            raise TypeError(f"aliases of flags {cls.__name__} does not have: {sorted(unknown)}")

    def _rank(self, flag: Flag) -> int:
        return self.sections.index(flag.group) if flag.group in self.sections else len(self.sections)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Add the flags, in argument groups by section."""
        groups = {title: parser.add_argument_group(title) for title in self.sections}
        for name, flag in self.by_name.items():
            group = groups.get(flag.group) or groups.setdefault(flag.group, parser.add_argument_group(flag.group))
            add_flag(group, name, self.aliases.get(name, ()), default=flag.flag_default, **flag.argparse_kwargs())

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """{field path: value} that the parsed flags give, in the fields' units."""
        return {flag.path: flag.value(args) for flag in self.flags}

    def build(self, args: argparse.Namespace, overrides: Mapping[str, Any] | None = None) -> Any:
        """The root config from the parsed flags; `overrides` ({field path: value}) set what no flag does."""
        return _construct(self.cls, {**self.values(args), **(overrides or {})}, "")


def _construct(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        path = prefix + f.name
        base, _ = _unwrap(_hints(cls)[f.name])
        nested = dataclasses.is_dataclass(base) and any(p.startswith(path + ".") for p in values)
        if path in values and not (nested and values[path]):
            kwargs[f.name] = values[path]
        elif nested:
            kwargs[f.name] = _construct(base, values, path + ".")
    return cls(**kwargs)


def comma_list(text: str) -> list[str]:
    """A flag's `type`: `a:1, b:2,` -> ["a:1", "b:2"]."""
    return [item.strip() for item in text.split(",") if item.strip()]


def float_mapping(form: str, example: str) -> Callable[[str], dict[str, float]]:
    """A flag's `type` for `NAME=NUMBER,...` -> {NAME: float}; `form` and `example` name it in the error (the
    names and ranges are the config's to check)."""
    def parse(text: str) -> dict[str, float]:
        mapping = {}
        for item in comma_list(text):
            name, sep, value = item.partition("=")
            try:
                if not sep or not name.strip():
                    raise ValueError
                mapping[name.strip()] = float(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected {form}[,...] (e.g. {example}), got {item!r}") from None
        return mapping
    return parse
