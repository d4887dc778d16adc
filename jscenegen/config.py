"""Typed run configuration: YAML files validated into pydantic models, with dotted overrides.

`load_config(path, overrides, model)` reads a YAML file, applies `key.sub=value` overrides
(values parsed as YAML scalars, the convention VERL/Hydra users know) and validates the result
into a pydantic model (`run_config.RunConfig` for `jscenegen train`). Each section lives with
its concern (`model.options.ModelConfig`, `sharding.mesh.MeshConfig`, ...); `Section` is their
base. Unknown keys and bad values raise `ConfigError` naming the dotted key.
"""
from __future__ import annotations

import datetime
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from jscenegen.paths import not_a_file
from jscenegen.text import clip_text, not_unicode


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the file and key."""


SEED_MAX = 2**32 - 1      # seeds are 32-bit: PRNG keys and NumPy generators take them whole
STEPS_MAX = 2**31 - 1     # update/step counts: int32 (orbax and VERL's step counters, torch's LambdaLR)
TOKENS_MAX = 1 << 20      # tokens of one turn, episode, bucket or chunk: beyond any context Qwen serves
REDACTED = "<redacted>"   # what a saved config or metadata file holds in place of a credential


def is_seed(value) -> bool:
    """Whether `value` is a seed: a JSON integer (not a boolean) in 0..SEED_MAX."""
    return type(value) is int and 0 <= value <= SEED_MAX


def _leaf_types(annotation) -> set:
    """The types a field annotated `annotation` holds, through Optional, unions, tuples and
    lists (`tuple[float, float] | None` -> {float}) and `Annotated` constraints; a `Literal`
    is kept whole (`Literal["a", "b"]`)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _leaf_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, tuple, list):
        return set().union(*(_leaf_types(a) for a in typing.get_args(annotation)
                             if a is not type(None) and a is not Ellipsis))
    return {annotation}


def _values(value) -> list:
    """`value`'s items, a list's or tuple's one by one (nested), else `value` alone."""
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _values(item)]
    return [value]


def wrong_scalar_type(annotation, value) -> str | None:
    """Why `value` does not fit a field annotated `annotation` although pydantic's lax mode
    would convert it, else None: a boolean where numbers belong (`true` read as 1), a string
    where only numbers belong (`"90"` as 90; a field that also takes text, `int |
    Literal["auto"]`, keeps its strings), a float where integers belong (`2.0` as 2),
    anything but true/false where a boolean belongs (`0` as false, `"yes"` as true)."""
    leaves, items = _leaf_types(annotation), [v for v in _values(value) if v is not None]
    takes_text = str in leaves or any(typing.get_origin(t) is typing.Literal for t in leaves)
    if leaves & {int, float}:
        if any(isinstance(v, bool) for v in items):
            return "expected a number, not a boolean"
        text = None if takes_text else next((v for v in items if isinstance(v, str)), None)
        if text is not None:
            if text.strip().lstrip("+-").lower() in ("inf", "infinity", "nan", ".inf", ".nan"):
                return "expected a finite number"
            return "expected a number, not a string"
    if leaves == {int} and (bad := next((v for v in items if isinstance(v, float)), None)) is not None:
        return f"expected an integer, not {bad!r}"
    if leaves == {bool} and (bad := next((v for v in items if not isinstance(v, bool)), None)) is not None:
        return f"expected true or false, not {shown_value(bad)}"
    return None


class PlainModel(BaseModel):
    """Base of every validated document (config sections, scene files): unknown keys are
    errors, values are immutable, floats finite (inf and nan are refused with the key named),
    and a value has the type its field declares, alone or in a list, never one pydantic's lax
    mode converts (`wrong_scalar_type`: `fsdp: true` read as 1, `betas: [false, 0.999]` as 0.0,
    `"yaw": "90"` as 90 degrees, `total_updates: 2.0` as 2, `remat: 0` as false); every
    string is Unicode text (no lone surrogate, which no tokenizer or file encodes). YAML
    configs are read with YAML 1.2's booleans and numbers (`_core_schema`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _plain_values(cls, value, info):
        field = cls.model_fields.get(info.field_name)
        if field is not None and (why := wrong_scalar_type(field.annotation, value)):
            raise ValueError(why)
        if isinstance(value, str) and (why := not_unicode(value)):
            raise ValueError(why)
        return value


class Section(PlainModel):
    """Base of every config section (`PlainModel`'s rules)."""


def dotted_items(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping flattened to {"section.key": value} (what an override names); a value
    that is not a mapping (a list included) is a leaf."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(dotted_items(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_fields(model: type[BaseModel], values: BaseModel | None = None,
                  prefix: str = "") -> list[tuple[str, str, Any, Any, str]]:
    """Every leaf key of the config schema `model`, depth first in declaration order:
    (dotted key, its type as the YAML takes it, the code's default, its value in `values` (an
    instance of `model`, e.g. a shipped config; None: not given), the field's description).
    A field whose type is itself a model is walked into, not listed."""
    rows = []
    for name, field in model.model_fields.items():
        key, value = prefix + name, getattr(values, name) if values is not None else None
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            rows += config_fields(field.annotation, value, key + ".")
            continue
        rows.append((key, _type_text(field.annotation, field.metadata), field.get_default(),
                     value, field.description or ""))
    return rows


def _type_text(annotation, metadata=()) -> str:
    """A field's type as a config file writes it: `int >= 1`, `int a multiple of 32`, `a | b`
    for choices, `list of str`, `... or null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        text = " | ".join(str(a) for a in args)
    elif origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        text = " or ".join(_type_text(a) for a in kept)
        if len(kept) < len(args):
            text += " or null"
    elif origin in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        if len(items) == 1 or (origin is list and items):
            text = f"list of {_type_text(items[0])}"
        else:
            text = f"[{', '.join(_type_text(a) for a in items)}]"
    elif origin is dict:
        text = f"map of {_type_text(args[0])} to {_type_text(args[1])}" if args else "map"
    else:
        text = getattr(annotation, "__name__", str(annotation))
    bounds = [f"{sign} {getattr(m, attr)}" for m in metadata
              for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                                 ("multiple_of", "a multiple of"))
              if getattr(m, attr, None) is not None]
    pattern = [getattr(m, "pattern") for m in metadata if getattr(m, "pattern", None)]
    if pattern and pattern[0].startswith("^(") and pattern[0].endswith(")$"):
        text = " | ".join(pattern[0][2:-2].split("|"))
    return " ".join([text, ", ".join(bounds)]).strip() if bounds else text


def _parse_value(text: str, item: str) -> Any:
    """An override's value as YAML (with the config files' guards), else the text itself;
    one that opens a list or mapping (`[`, `{`) must be valid YAML (ConfigError naming the
    override and the problem: a key given twice, an unclosed bracket)."""
    try:
        return load_yaml_text(text, f"override {clip_text(item)}")
    except yaml.YAMLError as err:
        if text.lstrip().startswith(("[", "{")):
            raise ConfigError(f"override {clip_text(item)}: not valid YAML: "
                              f"{_yaml_problem(err)}") from None
        return text


def override_value(item: str) -> Any:
    """The value of a `key=value` override as `apply_overrides` reads it (YAML: `{a: 1}` a
    mapping, `"x"` the string x), the raw text when the config files' guards refuse it; None
    for an item without `=`."""
    if "=" not in item:
        return None
    try:
        return _parse_value(item.split("=", 1)[1], item)
    except ConfigError:
        return item.split("=", 1)[1]


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of `data` with each `a.b.c=value` override set (value parsed as YAML); a
    mapping value sets its keys one by one (`schedule={group_size: 8}` is
    `schedule.group_size=8`: the section's other keys keep their values, as Hydra merges).

    Raises ConfigError for an override without `=`, a key given twice (a mapping's keys
    included), or one that descends into a non-mapping.
    """
    out = _unshared_copy(data)
    given: dict[str, str] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {clip_text(repr(item))} is not of the form key.sub=value")
        for leaf, value in _override_settings(item).items():
            if leaf in given:
                raise ConfigError(f"override {clip_text(item)}: {clip_text(leaf)} is already set "
                                  f"by override {clip_text(given[leaf])}; give each key once")
            given[leaf] = item
            if value == {} and isinstance(_dotted_get(out, leaf), dict):
                continue   # an empty mapping merged into a section: nothing to set
            section = set_dotted(out, leaf, value)
            if section is not None:
                setter = (f"set by override {clip_text(given[section])}" if section in given
                          else "in the config file")
                raise ConfigError(f"override {clip_text(repr(leaf))}: {clip_text(section)} is a "
                                  f"value {setter}, not a section")
    return out


def _unshared_copy(data: Any) -> Any:
    """A copy of nested dicts and lists in which no two places share an object: a YAML alias
    (`judge: *s`) read as the same dict as its anchor (`sampling: &s {...}`) would take an
    override of one as an override of both (copy.deepcopy keeps the sharing)."""
    if isinstance(data, dict):
        return {k: _unshared_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_unshared_copy(v) for v in data]
    return data


def override_leaf_keys(item: str) -> list[str]:
    """The dotted keys override `item` sets (`apply_overrides`): its key, or its mapping
    value's keys one by one (`sampling={top_k: 5}` sets `sampling.top_k`); none for an item
    without `=` (which `apply_overrides` refuses)."""
    return list(_override_settings(item)) if "=" in item else []


def refuse_override_of(flag: str, keys: set[str], overrides: Sequence[str]) -> None:
    """Raise ConfigError when an override (`override_leaf_keys`: a mapping value's keys too)
    sets one of `keys`, which a command-line flag decides; `flag` is a sentence on what the
    flag does (`--model names the policy`). The one rule of every command whose flags stand
    for config keys: each setting is given once."""
    given = [o for o in overrides if keys & set(override_leaf_keys(o))]
    if given:
        raise ConfigError(f"{flag}; the override {given[0]} contradicts or repeats it (give one "
                          "of the two)")


def _override_settings(item: str) -> dict[str, Any]:
    """{dotted key: value} the `key=value` override `item` sets (its value parsed as YAML)."""
    return _override_leaves(override_key(item), _parse_value(item.split("=", 1)[1], item))


def _override_leaves(key: str, value: Any) -> dict[str, Any]:
    """{dotted key: value} an override sets: a non-empty mapping's keys one by one (nested),
    anything else (an empty mapping included, so its key is still validated) at `key`."""
    if not isinstance(value, dict) or not value:
        return {key: value}
    out: dict[str, Any] = {}
    for sub, item in value.items():
        out.update(_override_leaves(f"{key}.{sub}", item))
    return out


def _dotted_get(data: dict, key: str) -> Any:
    """The value at dotted `key` in nested `data`, None when a part is missing."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def set_dotted(data: dict, key: str, value: Any) -> str | None:
    """Set `value` at the dotted `key` ("a.b.c": data["a"]["b"]["c"]) in place, making missing
    sections; nothing is set and the first section on the way that holds a value is returned
    (else None)."""
    node, parts = data, key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            return ".".join(parts[: i + 1])
        node = child
    node[parts[-1]] = value
    return None


def _blame(loc: tuple, source: str, overrides: list[str], message: str = "") -> str:
    """Who set the value at `loc`: the last override whose key is `loc` or lies above it (a
    list item); for a section-level check (`loc` a section), the overrides under it whose keys
    its `message` names, else every override under it, as the check may read any of them;
    else the config `source`."""
    key = [str(p) for p in loc]
    under = []
    for item in reversed(overrides):
        parts = override_key(item).split(".")
        n = min(len(parts), len(key))
        if parts[:n] != key[:n]:
            continue
        if len(parts) <= len(key):
            return f"override {clip_text(item)}"
        under.append(clip_text(item))
    named = [item for item in under if _names_key(message, override_key(item))]
    under = named or under
    if len(under) > 1:
        return f"overrides {', '.join(reversed(under))}"
    return f"override {under[0]}" if under else source


def _names_key(message: str, key: str) -> bool:
    """Whether `message` names the dotted `key` itself (not a longer key it begins)."""
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) is not None


def validation_message(error: dict) -> str:
    """One entry of pydantic's `ValidationError.errors()` as the sentence to print: the
    validator's own text without pydantic's "Value error, " / "Assertion failed, " prefix."""
    msg = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def shown_value(value: Any) -> str:
    """A refused input as the user wrote it in YAML or JSON (`true`, `null`, `"text"`, `[1, 2]`),
    cut by `clip_text`; Python's spelling for what JSON cannot write."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):   # bytes, non-finite floats, objects
        text = repr(value)
    return clip_text(text)


def override_key(item: str) -> str:
    """The dotted key of a `key.sub=value` override (`item` holds "=")."""
    return item.split("=", 1)[0].strip()


MAX_ERROR_LINES = 20


def _yaml_kind(value: Any) -> str | None:
    """What YAML made of unquoted text that is not a string ("a number", "a boolean", "a date"),
    else None."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return "a date"
    return None


def _format_errors(err: ValidationError, source: str, overrides: list[str] = (),
                   file_data: dict | None = None) -> str:
    """One line per error (the first MAX_ERROR_LINES, then how many more), each naming the
    file or override that set the value. A section-level check blamed on an override that
    names keys only the file `source` set (`file_data`: what it holds) says so ("configs/x.yaml
    sets sampling.top_p 0.9")."""
    lines = []
    errors = err.errors(include_url=False)
    for e in errors[:MAX_ERROR_LINES]:
        key = ".".join(str(p) for p in e["loc"])
        message = validation_message(e)
        where = _blame(tuple(e["loc"]), source, list(overrides), message)
        if e["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key {clip_text(repr(key))}")
        else:
            got = e.get("input")   # a section-level check's input is the whole section: not echoed
            shown = "" if isinstance(got, dict) or message.endswith(f" {shown_value(got)}") else \
                f" (got {shown_value(got)})"   # a message that ends with the value says it already
            if got is None and where.startswith("override ") and where.rstrip().endswith("="):
                shown = " (got no value: `key=` reads as null)"
            if e["type"] == "string_type" and (kind := _yaml_kind(got)):
                # YAML read the text as another type (and may have rewritten it: 007 is 7, 1.10 is 1.1)
                example = f"'{key}=\"...\"'" if where.startswith("override ") else f'{key.split(".")[-1]}: "..."'
                shown += f"; YAML read {kind} there: quote the text to keep it as typed, {example}"
            if isinstance(got, dict):   # a section-level check: it names the keys it read
                nulls = [o for o in overrides if o.endswith("=") and _names_key(message, override_key(o))]
                null_note = f" (`{nulls[0]}` reads as null)" if nulls else ""
                head = "" if message.startswith(f"{key}.") else f"{key}: "
                section = _dotted_get(file_data or {}, key)
                from_file = [f"{key}.{k} {shown_value(v)}" for k, v in
                             (section.items() if isinstance(section, dict) else ())
                             if where != source and _names_key(message, f"{key}.{k}")
                             and not any(f"{key}.{k}" in override_leaf_keys(o) for o in overrides)]
                file_note = f" ({source} sets {', '.join(from_file)})" if from_file else ""
                lines.append(f"{where}: {head}{message}{null_note}{file_note}")
            else:
                lines.append(f"{where}: {key}: {message}{shown}")
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"... and {len(errors) - MAX_ERROR_LINES:,} more errors")
    return "\n".join(lines)


def validate_config(data: dict, source: str, model: type[BaseModel],
                    overrides: list[str] | tuple[str, ...] = (), file_data: dict | None = None):
    """Validate a plain dict into the pydantic `model`; errors name each bad key and who set
    it: the override that did (`override a.b=value`), else `source` (whose own values, before
    the overrides, are `file_data`)."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, list(overrides), file_data)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last);
    merge keys (`<<: *defaults`) merge as YAML says, the mapping's own keys winning; booleans
    and numbers follow YAML 1.2's core schema (`_core_schema`). (libyaml's CSafeLoader parses
    ~10x faster but overflows the C stack on deeply nested input.)"""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, f"a key that is not a scalar ({type(key).__name__})",
                    key_node.start_mark) from None
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _ConfigDumper(yaml.SafeDumper):
    """yaml.SafeDumper that quotes a string `_UniqueKeyLoader` (YAML 1.2) or a YAML 1.1 reader
    (PyYAML's `safe_load`, an older jscenegen) would read as another type (`3e5`, `010`,
    `true`, `yes`)."""


_BOOL, _INT, _FLOAT = (f"tag:yaml.org,2002:{t}" for t in ("bool", "int", "float"))
_CORE_SCHEMA = (   # YAML 1.2.2, 10.3.2: (tag, pattern, the characters a match can start with)
    (_BOOL, r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    (_INT, r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (_FLOAT, r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
             r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789"),
)


def _core_schema(cls, *, keep_yaml_1_1: bool = False) -> None:
    """Resolve booleans and numbers as YAML 1.2's core schema does, not PyYAML's YAML 1.1:
    `yes`/`no`/`on`/`off` are text, `010` is ten (not octal eight), `1:30` is text (not
    base 60 ninety), `1_000` is text, and `1e-6`, `2.5e6` are numbers (1.1 read them as text).
    `keep_yaml_1_1` (a dumper) resolves both ways, so it quotes what either reading types."""
    if not keep_yaml_1_1:
        cls.yaml_implicit_resolvers = {
            first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _INT, _FLOAT)]
            for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, pattern, first in _CORE_SCHEMA:
        cls.add_implicit_resolver(tag, re.compile(pattern), list(first))


def _construct_int(loader, node) -> int:
    text = loader.construct_scalar(node)
    try:
        if text.startswith(("0o", "0x")):
            return int(text[2:], 8 if text[1] == "o" else 16)
        return int(text, 10)   # leading zeros are decimal
    except ValueError:   # beyond Python's 4,300-digit conversion limit
        raise yaml.constructor.ConstructorError(
            None, None, f"an integer of {len(text):,} digits", node.start_mark) from None


def _construct_float(loader, node) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    return math.nan if text == ".nan" else float(text)


def _refuse_tag(loader, node):
    raise yaml.constructor.ConstructorError(
        None, None, f"the tag {node.tag.rsplit(':', 1)[-1]!r}: a config holds strings, numbers, "
        "booleans, lists and mappings", node.start_mark)


_core_schema(_UniqueKeyLoader)
_core_schema(_ConfigDumper, keep_yaml_1_1=True)   # other readers of config.yaml read YAML 1.1
_UniqueKeyLoader.add_constructor(_INT, _construct_int)
_UniqueKeyLoader.add_constructor(_FLOAT, _construct_float)
# bytes (!!binary) would reach a string field decoded; a set's (!!set) order is the hash seed's
for _tag in ("binary", "set", "omap", "pairs"):
    _UniqueKeyLoader.add_constructor(f"tag:yaml.org,2002:{_tag}", _refuse_tag)


def dump_yaml(data: Any) -> str:
    """`data` as YAML text that `read_yaml` reads back as the same values (keys in order)."""
    return yaml.dump(data, Dumper=_ConfigDumper, sort_keys=False)


MAX_YAML_NODES = 1_000_000   # values after aliases are expanded: far above any config
MAX_CONFIG_BYTES = 2**20  # the shipped configs are ~2-5 KB; PyYAML's pure-Python loader takes
# 1.6 s for 1 MiB of a flat list, up to ~8 s for nested mappings


def _expanded_nodes(root: yaml.Node, limit: int) -> int | None:
    """How many values the document holds once every alias is expanded, counted without
    expanding (each node's count is computed once), stopping past `limit` ("billion laughs":
    a few lines whose aliases expand to 10^9 values); None when a node contains itself (`&a
    [*a]`, a mapping that merges itself)."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()   # on the current path from the root: met again = a cycle
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in counts:
            continue
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                else node.value if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            counts[id(node)] = min(limit + 1, 1 + sum(counts[id(k)] for k in kids))
            open_nodes.discard(id(node))
        elif id(node) in open_nodes:
            return None
        else:
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in counts)
    return counts[id(root)]


def load_yaml_text(text: str, where: str) -> Any:
    """The document in `text` (safe tags only, a key given twice refused). Raises yaml.YAMLError
    for bad syntax, ConfigError (naming `where`) when its aliases expand past MAX_YAML_NODES
    values or contain themselves, or it nests too deeply for the parser."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_nodes(node, MAX_YAML_NODES)
        if size is None:
            raise ConfigError(f"{where}: an alias refers to a value that contains it (a "
                              "recursive structure); write the values out")
        if size > MAX_YAML_NODES:
            raise ConfigError(f"{where}: its aliases expand to more than {MAX_YAML_NODES:,} "
                              "values (a YAML bomb?); write the values out")
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    finally:
        loader.dispose()


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error's problem in one line, with where its context (an open bracket) began."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context, cmark = getattr(err, "context", None), getattr(err, "context_mark", None)
    if context and cmark is not None:
        context += f" at line {cmark.line + 1}, column {cmark.column + 1}"
    return problem + (f" ({context})" if context else "")


def read_yaml(path: str | Path) -> dict:
    """The mapping in YAML file `path`.

    Raises ConfigError in one line: a missing or non-regular file, a syntax error as
    `FILE:LINE:COLUMN: not valid YAML: problem` (a key given twice in one mapping included),
    a file over MAX_CONFIG_BYTES, aliases that expand past MAX_YAML_NODES values, an empty
    file, or a top level that is not a mapping.
    """
    p = Path(path)
    if why := not_a_file(p):
        raise ConfigError(f"config file {path}: {why}")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path}: {size:,} bytes; a config is at most "
                          f"{MAX_CONFIG_BYTES:,} (refused unread)")
    try:
        data = load_yaml_text(p.read_text(encoding="utf-8"), str(path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(err)}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not a text file ({err.reason})") from None
    if data is None:
        raise ConfigError(f"{path}: empty config file (no sections); give at least one section, "
                          "or leave out --config for the CPU default")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None, overrides, model: type[BaseModel]):
    """Read YAML `path` (or start empty), apply overrides, validate into `model` (e.g.
    `run_config.RunConfig`, `sft.config.SFTRunConfig`).

    Raises ConfigError (missing file, YAML syntax, unknown key, wrong type), naming the
    override that set a bad value, else the file.
    """
    data: dict = {} if path is None else read_yaml(path)
    source = "<defaults>" if path is None else str(path)
    return validate_config(apply_overrides(data, list(overrides)), source, model, list(overrides),
                           file_data=data)
