"""How the routed-expert tensors of a checkpoint are named: the built-in naming schemes
(``BUILTIN_PATTERNS``), a user's own ``NamingPattern``, and the names of the shared
experts and routers reported beside them. Used by every file format's reader."""

from __future__ import annotations

import re
from dataclasses import dataclass

from numa_moe.files import CheckpointError
from numa_moe.formats import KINDS

__all__ = ["NamingPattern", "BUILTIN_PATTERNS", "SHARED_RE", "ROUTER_RE", "PATTERN_HELP", "parse_kind_map"]


@dataclass(frozen=True)
class NamingPattern:
    """How routed-expert tensors are named.

    ``regex`` is matched (``re.fullmatch``) against every tensor name and must have named
    groups ``layer`` and ``kind``, and ``expert`` when each expert has its own 2-D
    tensors; without ``expert`` the tensor is fused 3-D with experts along dimension 0.
    ``kinds`` maps the text of the ``kind`` group to ``gate``, ``up``, ``down`` or
    ``gate_up`` (fused [E, 2I, H], gate rows first).
    """

    name: str
    regex: str
    kinds: dict[str, str]

    def __post_init__(self):
        try:
            compiled = re.compile(self.regex)
        except re.error as err:
            raise CheckpointError(f"naming pattern {self.name!r}: bad regex {self.regex!r}: {err}") from err
        missing = {"layer", "kind"} - set(compiled.groupindex)
        if missing:
            raise CheckpointError(f"naming pattern {self.name!r}: the regex needs named groups "
                                  f"(?P<layer>...) and (?P<kind>...); missing {sorted(missing)}")
        bad = {v for v in self.kinds.values() if v not in (*KINDS, "gate_up")}
        if bad:
            raise CheckpointError(f"naming pattern {self.name!r}: kinds must map to gate, up, down "
                                  f"or gate_up; got {sorted(bad)}")

    @property
    def compiled(self) -> re.Pattern:
        return re.compile(self.regex)

    @property
    def fused(self) -> bool:
        return "expert" not in self.compiled.groupindex


_ANY_PREFIX = r"(?:.*\.)?"
BUILTIN_PATTERNS: tuple[NamingPattern, ...] = (
    NamingPattern("mixtral",
                  _ANY_PREFIX + r"layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+)"
                  r"\.(?P<kind>w1|w2|w3)\.weight",
                  {"w1": "gate", "w3": "up", "w2": "down"}),
    NamingPattern("mlp.experts",
                  _ANY_PREFIX + r"layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)"
                  r"\.(?P<kind>gate_proj|up_proj|down_proj)\.weight",
                  {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
    NamingPattern("fused",
                  _ANY_PREFIX + r"layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts"
                  r"\.(?P<kind>gate_up_proj|down_proj)(?:\.weight)?",
                  {"gate_up_proj": "gate_up", "down_proj": "down"}),
)
SHARED_RE = re.compile(_ANY_PREFIX + r"layers\.(?P<layer>\d+)\.mlp\.shared_experts?(?:_gate)?\..*")
ROUTER_RE = re.compile(_ANY_PREFIX + r"layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.gate\.weight")

PATTERN_HELP = (
    "Pass the naming pattern explicitly: on the command line\n"
    "    --pattern 'model\\.layers\\.(?P<layer>\\d+)\\.moe\\.experts\\.(?P<expert>\\d+)\\.(?P<kind>w1|w2|w3)\\.weight'"
    " --kinds w1=gate,w3=up,w2=down\n"
    "or in Python open_checkpoint(path, pattern=NamingPattern(name, regex, kinds)). The regex "
    "needs named groups layer and kind, plus expert unless the tensor is fused 3-D [E, rows, cols] "
    "(then map its kind to gate_up, gate, up or down). See docs/checkpoints.md.")


def parse_kind_map(text: str) -> dict[str, str]:
    """``"w1=gate,w3=up,w2=down"`` -> ``{"w1": "gate", ...}``."""
    mapping = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        if "=" not in item:
            raise CheckpointError(f"kind mapping item {item!r} is not NAME=KIND (e.g. w1=gate)")
        key, value = (s.strip() for s in item.split("=", 1))
        mapping[key] = value
    return mapping
