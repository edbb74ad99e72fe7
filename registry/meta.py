"""What a version carries besides its bytes: a description and labels, checked as input.

Labels are string pairs (``push --label stage=rc``); keys are names, values short text. Both are
stored with the version (versions.description, versions.labels) and shown by `show`, `ls` and the
Hub API's model info. No database import: the CLI parses --label before it opens anything.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from mfsreg.registry.errors import InvalidRequest, shown

DESCRIPTION_MAX = 1024
LABELS_MAX = 32
LABEL_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,63}")
LABEL_VALUE_MAX = 256


@dataclass(frozen=True)
class VersionMeta:
    """A push's description and labels."""

    description: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"description": self.description, "labels": dict(self.labels)}


def check_meta(description: object = "", labels: object = None) -> VersionMeta:
    """A VersionMeta from untrusted values (a request body, the CLI), else InvalidRequest."""
    description = "" if description is None else description
    if not isinstance(description, str) or len(description) > DESCRIPTION_MAX or "\0" in description:
        raise InvalidRequest(f"a description is text of at most {DESCRIPTION_MAX} characters; got {shown(description)}")
    labels = {} if labels is None else labels
    if not isinstance(labels, Mapping):
        raise InvalidRequest(f"labels are an object of strings; got {shown(labels)}")
    if len(labels) > LABELS_MAX:
        raise InvalidRequest(f"{len(labels)} labels: a version takes at most {LABELS_MAX}")
    for key, value in labels.items():
        check_label(key, value)
    return VersionMeta(description, dict(sorted(labels.items())))


def check_label(key: object, value: object) -> None:
    if not isinstance(key, str) or not LABEL_KEY.fullmatch(key):
        raise InvalidRequest(
            f"invalid label key {shown(key)}: use 1-64 letters, digits, '.', '_', '/' or '-', starting with a letter or digit"
        )
    if not isinstance(value, str) or len(value) > LABEL_VALUE_MAX or "\0" in value:
        raise InvalidRequest(f"label {key}: its value is text of at most {LABEL_VALUE_MAX} characters")


def parse_labels(pairs: Iterable[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (--label) as a dict; a key given twice, or a pair without '=', is refused."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            raise InvalidRequest(f"--label {shown(pair)}: write it as KEY=VALUE")
        check_label(key, value)
        if key in out:
            raise InvalidRequest(f"--label {key} is given twice: give each key once")
        out[key] = value
    return out


def labels_from_column(text: str | None) -> dict[str, str]:
    """The labels column as a dict (a row written before labels existed holds '{}')."""
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def labels_to_column(labels: Mapping[str, str]) -> str:
    return json.dumps(dict(labels), separators=(",", ":"), sort_keys=True)


def matches(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    """Whether ``labels`` hold every pair of ``wanted`` (ls --label)."""
    return all(labels.get(k) == v for k, v in wanted.items())
