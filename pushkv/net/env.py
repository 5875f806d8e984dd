"""Settings read from `PUSHKV_<NAME>` environment variables.

Two traps this module keeps out of every command:

- A bad value (`PUSHKV_PORT=abc`) is a usage error that names the variable
  (`EnvSettingError`, which the CLI reports as one line and exit 2), never a
  traceback from inside the parser's construction.
- Kubernetes injects service-link variables into every pod started after a
  Service exists (`enableServiceLinks`, on by default): a Service named
  `pushkv-router` gives `PUSHKV_ROUTER_PORT=tcp://10.0.0.7:8000`, which has the
  spelling of the router's port setting. Such a value (`tcp://`, `udp://` or
  `sctp://` then HOST:PORT) is never a pushkv setting, so it counts as unset.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

PREFIX = "PUSHKV_"
_SERVICE_LINK = re.compile(r"^(tcp|udp|sctp)://\S+:\d+$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class EnvSettingError(ValueError):
    """A `PUSHKV_*` variable whose value the setting cannot take."""


def is_service_link(value: str) -> bool:
    """Whether `value` is the form Kubernetes gives `<SERVICE>_PORT` variables."""
    return _SERVICE_LINK.match(value.strip()) is not None


def parse_bool(text: str) -> bool:
    """A boolean flag's or variable's text: 1/true/yes/on or 0/false/no/off."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{text!r} is not a boolean (true/false, 1/0, yes/no, on/off)")


def _converter(default: Any) -> Callable[[str], Any]:
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, int | float):
        return type(default)
    return str


def env_setting(
    name: str,
    default: Any,
    *,
    choices: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Any:
    """`PUSHKV_<NAME>` converted to `default`'s type, or `default` when unset
    (or a Kubernetes service link). Raises `EnvSettingError` naming the
    variable when the value does not convert or is not one of `choices`."""
    var = PREFIX + name.upper()
    raw = (os.environ if environ is None else environ).get(var)
    if raw is None or is_service_link(raw):
        return default
    try:
        value = _converter(default)(raw)
    except ValueError:
        kind = type(default).__name__
        raise EnvSettingError(f"{var}={raw!r}: not a valid {kind} value") from None
    if choices is not None and value not in choices:
        raise EnvSettingError(f"{var}={raw!r}: must be one of {', '.join(choices)}")
    return value
