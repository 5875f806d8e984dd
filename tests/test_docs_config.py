"""docs/configuration.md cannot rot: its reference tables are generated from the code.

The flag tables come from the `pushkv` argparse parser (pushkv/cli/main.py),
the environment variable of each flag is found by setting it and watching the
flag's default change, descriptions of settings come from the comments in
CoreSettings and ConnectorSettings, and the kv_connector_extra_config table
from ConnectorSettings' fields. Regenerate after changing any of them:

    .venv/bin/python -m tests.test_docs_config --write
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pushkv.cli import main as cli
from pushkv.controlplane.settings import CoreSettings
from pushkv.vllm_integration.settings import ConnectorSettings

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
COMMANDS = ("coordinator", "router", "relay", "status")
ENV_PREFIX = "PUSHKV_"
BLOCKS = ("flags", "extra_config")

# Descriptions of flags that have neither an argparse help text nor a settings
# comment (an argparse help text, when there is one, wins).
NOTES: dict[tuple[str, str], str] = {
    ("coordinator", "host"): "address to bind, for gRPC and (with --metrics-port) /metrics; "
    "0.0.0.0 for every interface",
    ("coordinator", "port"): "gRPC port; 0 picks a free port (see --port-file)",
    ("coordinator", "max_message_bytes"): "largest gRPC message received or sent",
    ("coordinator", "shutdown_grace_s"): "on SIGTERM/SIGINT health turns NOT_SERVING, then "
    "open RPCs get this long to finish",
    ("coordinator", "log_level"): "DEBUG, INFO, WARNING or ERROR; structlog to stderr "
    "(JSON lines when stderr is not a terminal)",
    ("coordinator", "heartbeat_interval_s"): "how often agents send a heartbeat (sent to them "
    "in Welcome); must be shorter than --lease-s",
    ("router", "coordinator"): "coordinator HOST:PORT, or the replicas' addresses "
    "comma-separated (the router follows the leader); engines are discovered with ListEngines",
    ("router", "host"): "address of the OpenAI-compatible HTTP API (also /health and /metrics)",
    ("router", "port"): "port of the HTTP API",
    ("router", "leg_timeout_s"): "time limit of each leg's whole HTTP request to an engine",
    ("router", "log_level"): "DEBUG, INFO, WARNING or ERROR; structlog to stderr as the "
    "coordinator's (JSON lines when stderr is not a terminal, the same keys)",
    ("relay", "log_level"): "DEBUG, INFO, WARNING or ERROR; structlog to stderr as the "
    "coordinator's (JSON lines when stderr is not a terminal, the same keys)",
}


# ---------------------------------------------------------------- sources


def class_source(cls: type) -> str:
    """The class's source text, read from its .py file (its module may run compiled)."""
    path = ROOT.joinpath(*cls.__module__.split(".")).with_suffix(".py")
    text = path.read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return "\n".join(text.splitlines()[node.lineno - 1 : node.end_lineno])
    raise LookupError(f"class {cls.__name__} not in {path}")


def field_comments(cls: type) -> dict[str, str]:
    """Comment lines above each dataclass field (a block covers the fields right below it)."""
    out: dict[str, str] = {}
    comment: list[str] = []
    current = ""
    prev_was_field = False
    for raw in class_source(cls).splitlines():
        line = raw.strip()
        if line.startswith("#"):
            if prev_was_field or not comment:
                comment = []
            comment.append(line.lstrip("#").strip())
            prev_was_field = False
            current = ""
            continue
        m = re.match(r"^(\w+)\s*:\s*[^=]+(=.*)?$", line)
        if m and not line.startswith(("def ", "return ")):
            if comment:
                current = " ".join(comment)
                comment = []
            out[m.group(1)] = current
            prev_was_field = True
            continue
        comment, current, prev_was_field = [], "", False
    return out


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """ "coordinator", "router", "status", "status get", ... -> parser."""
    out: dict[str, argparse.ArgumentParser] = {}
    top = subparsers(parser)
    for name in COMMANDS:
        out[name] = top[name]
        for sub, p in subparsers(top[name]).items():
            out[f"{name} {sub}"] = p
    return out


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in p._actions
        if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
        and a.default is not argparse.SUPPRESS
    ]


@contextmanager
def clean_env() -> Iterator[None]:
    saved = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def _probe_value(default: Any, choices: Any = None) -> str:
    if choices:  # a variable outside the choices is refused (pushkv/net/env.py)
        return str(next(c for c in choices if c != default))
    if isinstance(default, bool):
        return "0" if default else "1"
    if isinstance(default, int | float):
        return "7777"
    return "probe-value"


def env_vars(command: str, action: argparse.Action) -> list[str]:
    """Environment variables that change this flag's default (found by trying)."""
    dest = action.dest.upper()
    words = command.split()
    candidates = [ENV_PREFIX + dest, ENV_PREFIX + words[0].upper() + "_" + dest]
    found = []
    for name in candidates:
        os.environ[name] = _probe_value(action.default, action.choices)
        try:
            parser, _ = cli.build_parser()
            probed = next(
                a for a in options(command_parsers(parser)[command]) if a.dest == action.dest
            )
            if probed.default != action.default:
                found.append(name)
        finally:
            del os.environ[name]
    return found


# ---------------------------------------------------------------- rendering


def _default(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_flags() -> str:
    core = field_comments(CoreSettings)
    with clean_env():
        parser, _ = cli.build_parser()
        parsers = command_parsers(parser)
        out: list[str] = []
        all_env: dict[str, list[str]] = {}
        for command, p in parsers.items():
            acts = options(p)
            if not acts:
                continue
            out += [f"### `pushkv {command}`", ""]
            if command == "status":
                out += [
                    "These connection and output flags are also accepted after the "
                    "subcommand (`pushkv status ls --json`).",
                    "",
                ]
            out += ["| flag | environment | default | description |", "|---|---|---|---|"]
            for a in acts:
                flag = ", ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest.upper()}`"
                env = env_vars(command, a) if a.option_strings else []
                for e in env:
                    all_env.setdefault(e, []).append(f"`pushkv {command} {a.option_strings[0]}`")
                help_text = (a.help or "").replace("%(default)s", str(a.default))
                if re.fullmatch(r"default .*", help_text):
                    help_text = ""
                if not help_text:
                    help_text = NOTES.get((command, a.dest), "")
                if not help_text and command == "coordinator":
                    help_text = core.get(a.dest, "")
                if a.choices:
                    help_text += f" (one of: {', '.join(map(str, a.choices))})"
                default = "(required)" if a.required else _default(a.default)
                if not a.option_strings:
                    default = "(positional)"
                out.append(
                    f"| {flag} | {', '.join(f'`{e}`' for e in env) or '-'} | {default} "
                    f"| {_cell(help_text.strip()) or '-'} |"
                )
            out.append("")
    out += [
        "### Environment variables of the flags",
        "",
        "| variable | sets |",
        "|---|---|",
    ]
    out += [f"| `{e}` | {', '.join(flags)} |" for e, flags in sorted(all_env.items())]
    return "\n".join(out).rstrip() + "\n"


def render_extra_config() -> str:
    comments = field_comments(ConnectorSettings)
    out = ["| key | type | default | description |", "|---|---|---|---|"]
    for f in dataclasses.fields(ConnectorSettings):
        default = "(required)" if f.default is dataclasses.MISSING else _default(f.default)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        out.append(
            f"| `{f.name}` | {kind} | {default} | {_cell(comments.get(f.name, '')) or '-'} |"
        )
    return "\n".join(out) + "\n"


RENDER = {"flags": render_flags, "extra_config": render_extra_config}


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- BEGIN GENERATED {name}: python -m tests.test_docs_config --write -->\n",
        f"<!-- END GENERATED {name} -->",
    )


def splice(doc: str, name: str, body: str) -> str:
    begin, end = _markers(name)
    i, j = doc.index(begin) + len(begin), doc.index(end)
    return doc[:i] + body + doc[j:]


def current(doc: str, name: str) -> str:
    begin, end = _markers(name)
    return doc[doc.index(begin) + len(begin) : doc.index(end)]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name", BLOCKS)
def test_generated_tables_are_current(name: str) -> None:
    doc = DOC.read_text()
    assert current(doc, name) == RENDER[name](), (
        f"docs/configuration.md ({name}) is stale: run "
        "`.venv/bin/python -m tests.test_docs_config --write`"
    )


def test_every_flag_and_key_is_documented() -> None:
    doc = DOC.read_text()
    with clean_env():
        parser, _ = cli.build_parser()
        for command, p in command_parsers(parser).items():
            for a in options(p):
                for o in a.option_strings:
                    assert f"`{o}`" in doc, f"pushkv {command} {o} is not documented"
    for f in dataclasses.fields(ConnectorSettings):
        assert f"`{f.name}`" in doc, f"kv_connector_extra_config.{f.name} is not documented"


def test_every_pushkv_environment_variable_is_documented() -> None:
    doc = DOC.read_text()
    names: set[str] = set()
    # pushkv/ holds the rest (and links to the design's folders).
    for folder in ("controlplane", "agent", "vllm_integration", "pushkv", "scripts", "tests"):
        assert (ROOT / folder).is_dir(), folder
        for path in [*(ROOT / folder).rglob("*"), ROOT / "setup.py"]:
            if path.suffix in (".py", ".sh"):
                names |= set(re.findall(r"PUSHKV_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert names, "no PUSHKV_ variables found at all?"
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"undocumented environment variables: {missing}"


def test_comment_parser() -> None:
    comments = field_comments(CoreSettings)
    assert comments["lease_s"].startswith("Agent lease")
    # One comment covers the fields right below it.
    assert comments["max_terminal"] == comments["retention_s"]
    assert field_comments(ConnectorSettings)["coordinator"].startswith("host:port")


def test_readme_stays_a_page() -> None:
    # The README is what a new user reads first: two commands, then pointers.
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the limit is 250 (move detail to docs/)"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.test_docs_config --write")
    text = DOC.read_text()
    for block in BLOCKS:
        text = splice(text, block, RENDER[block]())
    DOC.write_text(text)
    print(f"updated {DOC.relative_to(ROOT)}")
