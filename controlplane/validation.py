"""Input checks shared by the core: every failure names the offending field."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pushkv.controlplane.domain import EngineId, TransferId
from pushkv.controlplane.errors import InvalidArgument
from pushkv.rules.block_groups import BlockGroups

# Ids travel inside NIXL notifications, so '|' and whitespace are excluded.
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@\-]*$")
MAX_TOKENS = 16_777_216


def check_id(value: str, *, field: str, max_len: int) -> str:
    if not value:
        raise InvalidArgument("must not be empty", field=field)
    if len(value) > max_len:
        raise InvalidArgument(f"longer than {max_len} characters", field=field)
    if not _ID.match(value):
        raise InvalidArgument(
            "may hold only letters, digits and . _ : @ - (and must start with a letter or digit)",
            field=field,
        )
    return value


def transfer_id(value: str, max_len: int) -> TransferId:
    return TransferId(check_id(value, field="transfer_id", max_len=max_len))


def valid_transfer_id(value: str, max_len: int) -> bool:
    """Whether `transfer_id` would accept `value` (an adopted id: skipped if not)."""
    return 0 < len(value) <= max_len and _ID.match(value) is not None


def engine_id(value: str, *, field: str, max_len: int) -> EngineId:
    return EngineId(check_id(value, field=field, max_len=max_len))


def num_tokens(value: int, *, field: str = "num_tokens") -> int:
    if value <= 0:
        raise InvalidArgument("must be > 0", field=field)
    if value > MAX_TOKENS:
        raise InvalidArgument(f"must be <= {MAX_TOKENS}", field=field)
    return value


def blocks(
    groups: Sequence[Sequence[int]],
    *,
    field: str,
    max_groups: int,
    max_per_group: int,
    num_groups: int | None = None,
    num_blocks: int | None = None,
    max_total: int | None = None,
) -> BlockGroups:
    if not groups:
        raise InvalidArgument("needs one list of block ids per KV group", field=field)
    if len(groups) > max_groups:
        raise InvalidArgument(f"more than {max_groups} KV groups", field=field)
    if max_total is not None and (total := sum(len(g) for g in groups)) > max_total:
        raise InvalidArgument(
            f"{total} block ids in all, more than {max_total} (--max-blocks-per-side)", field=field
        )
    if num_groups is not None and len(groups) != num_groups:
        raise InvalidArgument(
            f"has {len(groups)} KV groups; the engine's KV layout has {num_groups}", field=field
        )
    out: list[tuple[int, ...]] = []
    limit = num_blocks if num_blocks is not None else math.inf
    for g, ids in enumerate(groups):
        group = tuple(ids)
        n = len(group)
        # Fast path: one pass each in C; the loop below names the first problem.
        if n <= max_per_group and (
            not n or (min(group) >= 0 and max(group) < limit and len(set(group)) == n)
        ):
            out.append(group)
            continue
        where = f"{field}[{g}]"
        if len(ids) > max_per_group:
            raise InvalidArgument(f"more than {max_per_group} block ids", field=where)
        seen: set[int] = set()
        for b in ids:
            if b < 0:
                raise InvalidArgument(f"negative block id {b}", field=where)
            if num_blocks is not None and b >= num_blocks:
                raise InvalidArgument(
                    f"block id {b} outside the engine's {num_blocks} blocks", field=where
                )
            if b in seen:
                raise InvalidArgument(f"duplicate block id {b}", field=where)
            seen.add(b)
        out.append(tuple(ids))
    return BlockGroups(tuple(out))
