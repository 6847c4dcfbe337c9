"""The job file's YAML: parsing with each key's line, duplicate keys refused, and --set overrides.

Why apart from spec.py: YAML's own behaviour is what surprises users here (a repeated key or
section silently keeps the last one; YAML 1.1 reads an unquoted `no` as false), so the parser
records what it saw, per dotted key, for spec.py's error messages to point at.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

from batchgen.errors import JobFileError

_MERGE_TAG = "tag:yaml.org,2002:merge"
_BOOL_TAG = "tag:yaml.org,2002:bool"
# YAML 1.1 booleans a user rarely means as one (true/false are left out: those are meant).
_SURPRISING_BOOLS = {"yes", "no", "on", "off"}


@dataclass
class ParsedYaml:
    """A parsed document and where its keys were: dotted key -> 1-based line."""

    data: Any
    lines: dict[str, int] = field(default_factory=dict)
    # dotted key of a value YAML read as a boolean from yes/no/on/off -> (line, or 0 in a --set; the word)
    bool_words: dict[str, tuple[int, str]] = field(default_factory=dict)


class DuplicateKey(ValueError):
    """A mapping holds one key twice; YAML would silently keep the last value."""

    def __init__(self, dotted: str, line: int, first: int) -> None:
        super().__init__(f"{dotted}: duplicate key (first at line {first})")
        self.dotted, self.line, self.first = dotted, line, first


def parse_yaml(text: str, prefix: str = "") -> ParsedYaml:
    """Parse one YAML document; keys are recorded under `prefix` (a --set value's key).

    Raises yaml.YAMLError for text that is not YAML, DuplicateKey for a repeated key."""
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    parsed = ParsedYaml(data=None)
    if node is None:
        return parsed
    _walk(node, prefix, parsed, frozenset())
    loader = yaml.SafeLoader("")
    try:
        parsed.data = loader.construct_document(node)
    finally:
        loader.dispose()
    return parsed


def _walk(node: yaml.Node, dotted: str, parsed: ParsedYaml, ancestors: frozenset[int]) -> None:
    if id(node) in ancestors:  # why: an anchor may alias its own ancestor; YAML allows the cycle
        return
    inside = ancestors | {id(node)}
    if isinstance(node, yaml.ScalarNode):
        if node.tag == _BOOL_TAG and node.value.lower() in _SURPRISING_BOOLS:
            parsed.bool_words[dotted] = (node.start_mark.line + 1, node.value)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, _join(dotted, str(i)), parsed, inside)
    elif isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:  # `<<: *defaults`: its keys may be overridden here
                continue
            key = _join(dotted, str(key_node.value))
            line = key_node.start_mark.line + 1
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    raise DuplicateKey(key, line, seen[key_node.value])
                seen[key_node.value] = line
            parsed.lines[key] = line
            _walk(value_node, key, parsed, inside)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def apply_override(raw: dict[str, Any], item: str, parsed: ParsedYaml) -> str:
    """Apply one `section.key=value` override to `raw` (the value is parsed as YAML: 64, 0.7,
    [a, b]); returns the dotted key. What the value's parse saw is added to `parsed`."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise JobFileError(f"--set {item!r}: expected section.key=value")
    parts = key.strip().split(".")
    dotted = ".".join(parts)
    target = raw
    for part in parts[:-1]:
        child = target.get(part)
        if child is None:  # absent, or a section with every key commented out (YAML null)
            child = target[part] = {}
        if not isinstance(child, dict):
            raise JobFileError(f"--set {item!r}: {part!r} is not a section")
        target = child
    try:
        value_parse = parse_yaml(value, dotted) if value.strip() else ParsedYaml(data=None)
    except DuplicateKey as exc:
        raise JobFileError(f"--set {item!r}: {exc.dotted.removeprefix(dotted + '.')}: duplicate key") from None
    except yaml.YAMLError as exc:
        raise JobFileError(f"--set {item!r}: value is not valid YAML: {exc}") from None
    target[parts[-1]] = value_parse.data
    # why drop what the file said below this key: the --set replaced it
    parsed.bool_words = {k: v for k, v in parsed.bool_words.items() if not at_or_below(k, dotted)}
    parsed.bool_words.update({k: (0, word) for k, (_, word) in value_parse.bool_words.items()})  # 0: no file line
    return dotted


def at_or_below(key: str, ancestor: str) -> bool:
    return key == ancestor or key.startswith(ancestor + ".")
