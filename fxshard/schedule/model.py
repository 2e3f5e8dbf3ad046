"""The schedule as data: actions, the per-rank `Schedule`, where chunks are placed, and the
transfers a per-rank compute order implies (`add_communication`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import FxShardError


COMPUTE = ("F", "B", "W")
TRANSFERS = ("SF", "RF", "SB", "RB")
ZERO = ("U", "R", "G")   # per-chunk collectives over dp: unshard, reshard, reduce-grad
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Action:
    kind: str                # F, B, W, SF, RF, SB, RB, U, R, G, OPT
    chunk: int = -1
    mb: int = -1             # -1 for U / R / G: they act on a chunk once, not per microbatch
    peer: int | None = None  # the other rank of a send / receive

    def __str__(self) -> str:
        if self.kind == "OPT":
            return "OPT"
        if self.kind in ZERO:
            return f"{self.kind}{self.chunk}"
        token = f"{self.kind}{self.chunk}:{self.mb}"
        if self.peer is not None:
            token += (">" if self.kind.startswith("S") else "<") + str(self.peer)
        return token

    @classmethod
    def parse(cls, token: str) -> "Action":
        if token == "OPT":
            return cls("OPT")
        kind = next((k for k in (*TRANSFERS, *COMPUTE, *ZERO) if token.startswith(k)), None)
        text, peer, peer_ok = token, None, True
        marks = [mark for mark in "<>" if mark in token]
        if marks:  # a send names its peer with >, a receive with <; nothing else has one
            text, _, peer_text = token.partition(marks[0])
            wanted = ">" if kind in ("SF", "SB") else "<" if kind in ("RF", "RB") else None
            peer_ok = len(marks) == 1 and marks[0] == wanted and peer_text.isdigit()
            peer = int(peer_text) if peer_ok else None
        rest = text[len(kind or ""):]
        if kind in ZERO and rest.isdigit() and not marks:
            return cls(kind, int(rest))
        chunk, _, mb = rest.partition(":")
        if kind is None or kind in ZERO or not (chunk.isdigit() and mb.isdigit()) or not peer_ok or \
                (kind in TRANSFERS) != (peer is not None):
            raise FxShardError(f"schedule action {token!r}: write F1:3, B1:3, W1:3 (chunk:microbatch), SF1:3>2, "
                               f"RF1:3<0, SB / RB likewise (a send >peer, a receive <peer), U1 / R1 / G1 (chunk) "
                               f"or OPT")
        return cls(kind, int(chunk), int(mb), peer)


def matching(action: Action) -> tuple[str, int, int]:
    """The (kind, chunk, mb) of the other side of a transfer: SF c:m pairs with RF c+1:m, SB c:m with RB c-1:m."""
    kind, c, mb = action.kind, action.chunk, action.mb
    return {"SF": ("RF", c + 1, mb), "RF": ("SF", c - 1, mb), "SB": ("RB", c - 1, mb), "RB": ("SB", c + 1, mb)}[kind]


def place(chunk: int, stages: int, placement: str) -> int:
    """The rank holding `chunk` = v*P + i: rank i under "loop"; under "v" the odd rounds walk back,
    rank P-1-i, so with V=2 rank r holds chunks r and 2P-1-r (first and last chunk on rank 0)."""
    v, i = divmod(chunk, stages)
    return stages - 1 - i if placement == "v" and v % 2 else i


@dataclass(frozen=True)
class Schedule:
    """`ranks[r]` is rank r's ordered actions; P ranks, V chunks per rank, M microbatches, and the
    placement of chunks on ranks ("loop" or "v", see `place`); `rank_of` is the one source of it."""

    ranks: tuple[tuple[Action, ...], ...]
    stages: int
    virtual: int
    microbatches: int
    name: str = ""
    placement: str = "loop"

    def __post_init__(self):
        # tuples, whatever the caller built it from: a Schedule is hashed (order.combine_pairs caches on it)
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        if self.placement not in PLACEMENTS:
            raise FxShardError(f"Schedule placement {self.placement!r}; choose one of {PLACEMENTS} (\"v\": rank r "
                               f"holds chunks r and 2P-1-r)")
        for name in ("stages", "virtual", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise FxShardError(f"Schedule {name} must be an int >= 1, got {value!r}")
        if len(self.ranks) != self.stages:
            raise FxShardError(f"a Schedule of {self.stages} stages lists the actions of {len(self.ranks)} ranks; "
                               f"give one action list per rank")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        return place(chunk, self.stages, self.placement)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "stages": self.stages, "virtual": self.virtual,
                           "microbatches": self.microbatches, "placement": self.placement,
                           "ranks": [[str(a) for a in actions] for actions in self.ranks]})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """The schedule `to_json` wrote, from that text (not a path: `Schedule.from_json(open(path).read())`)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as error:
            raise FxShardError(f"Schedule.from_json takes the JSON text Schedule.to_json wrote ({error}); for a file, "
                               f"pass its text: Schedule.from_json(open(path).read())") from None
        ranks = data.get("ranks", []) if isinstance(data, dict) else None
        if not isinstance(ranks, list) or not all(isinstance(actions, list) and all(isinstance(t, str) for t in actions)
                                                  for actions in ranks):
            raise FxShardError("a schedule's JSON is an object whose 'ranks' lists each rank's actions as strings "
                               "('F0:1', 'SF0:1>1', 'OPT'), as Schedule.to_json writes it")
        missing = [key for key in ("ranks", "stages", "virtual", "microbatches") if key not in data]
        if missing:
            raise FxShardError(f"a schedule's JSON needs {missing} (Schedule.to_json writes every field)")
        return cls(tuple(tuple(Action.parse(t) for t in actions) for actions in data["ranks"]),
                   data["stages"], data["virtual"], data["microbatches"], data.get("name", ""),
                   data.get("placement", "loop"))  # written before placements existed: loop


def add_communication(order: list[list[Action]], stages: int, virtual: int, microbatches: int,
                      name: str, placement: str = "loop") -> Schedule:
    """Insert the receive before and the send after every compute action whose neighbour chunk lives
    on another rank (under `placement`), and the optimizer step at the end."""
    chunks = stages * virtual
    ranks = []
    for rank, actions in enumerate(order):
        out = []
        for action in actions:
            c, mb = action.chunk, action.mb
            before, after = place(c - 1, stages, placement), place(c + 1, stages, placement)
            if action.kind == "F" and c > 0 and before != rank:
                out.append(Action("RF", c, mb, before))
            if action.kind == "B" and c < chunks - 1 and after != rank:
                out.append(Action("RB", c, mb, after))
            out.append(action)
            if action.kind == "F" and c < chunks - 1 and after != rank:
                out.append(Action("SF", c, mb, after))
            if action.kind == "B" and c > 0 and before != rank:
                out.append(Action("SB", c, mb, before))
        out.append(Action("OPT"))
        ranks.append(tuple(out))
    return Schedule(tuple(ranks), stages, virtual, microbatches, name, placement)
