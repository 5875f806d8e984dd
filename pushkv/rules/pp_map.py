"""Pipeline-parallel prefill into a decode engine holding every layer.

A prefill engine of PP size S runs S stages, each holding its own layers'
KV caches: the regions of stage s's ranks carry the layers of stage s only
(KVRegion.layer). A decode engine of PP 1 holds every layer. Each prefill rank
(stage s, TP rank t) writes its regions into the decode regions of the same
layers, on the decode ranks its TP rank maps to (pushkv/rules/tp_map.py, unchanged);
each such decode rank then expects a writer from every stage. Pairing needs
every region's layer on both sides, and the stages' layers together must be
exactly the decode's (each layer's regions alike). Decode PP > 1 is refused:
its stages would each need the layers of a prefill stage split differently.
Pure Python on plain values, typed for mypyc.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pushkv.rules.pairing import KVShape


def merge_stages(stages: Sequence[KVShape]) -> KVShape:
    """One shape of a PP engine from each stage's (its TP rank 0's) shape:
    every stage's regions and layers, stage 0's first; the rest from stage 0."""
    first = stages[0]
    regions: list[tuple[int, int]] = []
    layers: list[int] = []
    for s in stages:
        regions.extend(s.regions)
        layers.extend(s.layers if len(s.layers) == len(s.regions) else (-1,) * len(s.regions))
    return first.with_regions(tuple(regions), tuple(layers), len(stages))


def pp_mismatch(p: KVShape, d: KVShape) -> str:
    """Why a prefill engine of PP `p.pp_size` cannot write into a decode
    engine of PP `d.pp_size` by layer, or "" (TP and layout checked apart)."""
    if d.pp_size > 1:
        return (
            f"decode pipeline parallelism (PP {d.pp_size}) is not supported: a decode "
            "engine must hold every layer (--pipeline-parallel-size 1); prefill may run PP"
        )
    if p.pp_size <= 1:
        return ""
    what = f"prefill PP {p.pp_size} into decode PP 1"
    if len(p.layers) != len(p.regions) or min(p.layers, default=0) < 0:
        return f"{what}: the prefill engine does not report every KV region's layer"
    if len(d.layers) != len(d.regions) or min(d.layers, default=0) < 0:
        return f"{what}: the decode engine does not report every KV region's layer"
    p_keys = sorted(_keys(p))
    d_keys = sorted(_keys(d))
    if p_keys != d_keys:
        p_set = {layer for _, layer, _ in p_keys}
        d_set = {layer for _, layer, _ in d_keys}
        missing, extra = sorted(d_set - p_set), sorted(p_set - d_set)
        more = sorted({layer for key in set(p_keys) - set(d_keys) for layer in [key[1]]} & d_set)
        fewer = sorted({layer for key in set(d_keys) - set(p_keys) for layer in [key[1]]} & p_set)
        return (
            f"{what}: the prefill stages' layers together must be the decode engine's, "
            f"each with as many KV regions (prefill {len(p_set)} layers in "
            f"{len(p.regions)} regions, decode {len(d_set)} layers in {len(d.regions)} "
            f"regions; missing {_some(missing)}, extra {_some(extra)}, layers with "
            f"more regions than decode: {_some(more)}, with fewer: {_some(fewer)})"
        )
    return ""


def by_layer(s: KVShape) -> KVShape:
    """`s` with its regions in (group, layer) order (`pp_mismatch` found every
    layer reported), so that two engines' regions pair by index."""
    order = sorted(range(len(s.regions)), key=lambda i: (s.regions[i][0], s.layers[i], i))
    return s.with_regions(
        tuple([s.regions[i] for i in order]), tuple([s.layers[i] for i in order]), s.pp_size
    )


def region_map(src_layers: Sequence[int], dst_layers: Sequence[int]) -> tuple[int, ...]:
    """The index of the destination region each source region goes into: the
    k-th source region of a layer into the k-th destination region of that
    layer. Raises ValueError where a layer has no such destination region."""
    where: dict[int, list[int]] = {}
    for i, layer in enumerate(dst_layers):
        where.setdefault(layer, []).append(i)
    seen: dict[int, int] = {}
    out: list[int] = []
    for layer in src_layers:
        k = seen.get(layer, 0)
        slots = where.get(layer, [])
        if k >= len(slots):
            raise ValueError(f"layer {layer}: no destination region {k}")
        out.append(slots[k])
        seen[layer] = k + 1
    return tuple(out)


def _keys(s: KVShape) -> list[tuple[int, int, int]]:
    """(group, layer, occurrence of that group and layer) per region."""
    seen: dict[tuple[int, int], int] = {}
    out: list[tuple[int, int, int]] = []
    for (group, _), layer in zip(s.regions, s.layers, strict=True):
        k = seen.get((group, layer), 0)
        seen[(group, layer)] = k + 1
        out.append((group, layer, k))
    return out


def _some(layers: list[int]) -> str:
    if not layers:
        return "none"
    text = ", ".join(str(x) for x in layers[:8])
    return f"[{text}{', ...' if len(layers) > 8 else ''}]"
