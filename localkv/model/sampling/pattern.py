"""A JSON schema's ``pattern`` as GBNF: a deterministic automaton, one rule per state.

llama-cpp-python's schema converter writes a pattern into GBNF almost as it
reads it (``(a?){3}`` becomes three optional items in a row), so an ambiguous
pattern becomes an ambiguous grammar. llama.cpp keeps a parse stack for every
way the text so far can be read, and before each token it checks the whole
vocabulary by following every way each token's characters can be read, one
stack at a time and with no cap: one token's work grows with the pattern's
ambiguity to the power of a token's length, inside a single native call that
nothing interrupts. ``(a|a|aa)*(a?){400}b`` is a forty-character pattern that
holds the model for minutes per token. The converter also hands escapes
such as ``\\d`` and ``\\.`` to GBNF, which has none, and writes a ``"`` in the
pattern as a raw quote inside the JSON string.

Here the pattern (ECMAScript syntax, as JSON Schema specifies) becomes a
Thompson automaton, then a deterministic one by subset construction, and each
state a GBNF rule whose alternatives start with disjoint characters. The
grammar is in one place of the pattern at a time, so llama.cpp follows a
single reading of any token: a token costs what it costs under ``[a-z]*``,
whatever the pattern. The price of ambiguity is paid once, here, and bounded
(``MAX_PATTERN_POSITIONS``, ``MAX_PATTERN_STATES``, ``MAX_PATTERN_WORK``); a
pattern past a bound is a ``GrammarError`` naming it.

Characters JSON must escape in a string (``"``, ``\\``, U+0000 to U+001F) are
written as their JSON escapes, so the text sampled is a JSON string whose value
matches the pattern. Supported: literals and escapes (``\\d \\w \\s``, their
negations, ``\\t \\n \\v \\f \\r \\0 \\xHH \\uHHHH \\cX``, escaped punctuation),
``.``, classes, groups (``(?:...)``, ``(?<name>...)``), ``|``, ``* + ? {n}
{n,} {n,m}`` (lazy or not: the same strings). The pattern must match the whole
string, as the converter asks: each top-level alternative starts with ``^`` and
ends with ``$``. Lookarounds, backreferences and ``\\b`` are refused.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NoReturn

from localkv.model.sampling.errors import GrammarError

__all__ = [
    "MAX_PATTERN_POSITIONS",
    "MAX_PATTERN_REPEAT",
    "MAX_PATTERN_STATES",
    "MAX_PATTERN_WORK",
    "pattern_rules",
]

MAX_PATTERN_REPEAT = 1_000  # a {n,m} count, as minLength and maxItems (grammar.MAX_REPEAT)
# characters of the pattern once its repetitions are written out (a node each): a
# repetition of a two-character group at its largest count fits
MAX_PATTERN_POSITIONS = 2 * MAX_PATTERN_REPEAT
# states of the deterministic automaton (a GBNF rule each): a pattern that can be
# read one way only has a state per position and one to start; more states are the
# price of reading it several ways at once, paid here instead of at every token
MAX_PATTERN_STATES = MAX_PATTERN_POSITIONS + 1
# Thompson nodes the construction visits, 64 a state of the largest automaton: a
# pattern read one way visits the few nodes between one character and the next, one
# read many ways visits many at each step; past it the pattern is refused before
# its conversion, which runs as the request is parsed, costs more time
MAX_PATTERN_WORK = 64 * MAX_PATTERN_STATES

_MAX_CODE = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]  # inclusive code point ranges, sorted and disjoint


@dataclass(frozen=True, slots=True)
class _Chars:
    ranges: Ranges  # one character of these


@dataclass(frozen=True, slots=True)
class _Sequence:
    parts: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class _Choice:
    parts: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class _Repeat:
    inner: Node
    lo: int
    hi: int | None  # None: no upper bound


Node = _Chars | _Sequence | _Choice | _Repeat  # a parsed pattern


def _ranges(pairs: Iterable[tuple[int, int]]) -> Ranges:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(pairs):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODE:
        out.append((start, _MAX_CODE))
    return tuple(out)


def _intersect(a: Ranges, b: Ranges) -> Ranges:
    return _complement(_ranges(_complement(a) + _complement(b)))


_DOT = _complement(_ranges([(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]))
_DIGIT: Ranges = ((0x30, 0x39),)
_WORD = _ranges([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
_SPACE = _ranges(
    [
        *((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)),
        *((0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)),
    ]
)
_SETS = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHARS = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D}
_QUANTIFIER = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
# the escapes JSON has for the characters it does not allow raw in a string
_JSON_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_ESCAPED: Ranges = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_NOT_SURROGATES = _complement(((0xD800, 0xDFFF),))


def _text(ranges: Ranges) -> _Chars:
    """The characters of ``ranges`` that a string can hold (no lone surrogate halves)."""
    return _Chars(_intersect(ranges, _NOT_SURROGATES))


def _shown(pattern: str) -> str:
    return repr(pattern if len(pattern) <= 80 else pattern[:77] + "...")


class _Parser:
    """ECMAScript pattern syntax (the subset the module describes) -> a ``Node``."""

    def __init__(self, text: str) -> None:
        self.text, self.i, self.depth = text, 0, 0

    def fail(self, why: str) -> NoReturn:
        raise GrammarError(f"the pattern {_shown(self.text)}: {why} (at character {self.i})")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.text[j] if j < len(self.text) else ""

    def parse(self) -> Node:
        alternatives = [self.anchored()]
        while self.peek() == "|":
            self.i += 1
            alternatives.append(self.anchored())
        if self.i < len(self.text):
            self.fail("unbalanced ')'")
        return _Choice(tuple(alternatives))

    def anchored(self) -> Node:
        """One top-level alternative, which must be anchored at both ends."""
        start = self.peek() == "^"
        self.i += start
        body = self.sequence()
        end = self.peek() == "$"
        self.i += end
        if not (start and end):
            self.fail('each alternative must start with "^" and end with "$" (a whole string)')
        return body

    def alternation(self) -> Node:
        alternatives = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alternatives.append(self.sequence())
        return _Choice(tuple(alternatives)) if len(alternatives) > 1 else alternatives[0]

    def sequence(self) -> Node:
        items: list[Node] = []
        while (c := self.peek()) and c not in "|)":
            if c == "$":
                if self.depth or self.peek(1) not in ("", "|"):
                    self.fail("'$' may only end the pattern or a top-level alternative")
                break
            if c == "^":
                self.fail("'^' may only start the pattern or a top-level alternative")
            items.append(self.quantified(self.atom()))
        return _Sequence(tuple(items))

    def quantified(self, atom: Node) -> Node:
        bounds = self.quantifier()
        if bounds is None:
            return atom
        if self.peek() == "?":
            self.i += 1  # lazy: the same strings
        if self.peek() in ("*", "+", "?") or self.quantifier(peek=True) is not None:
            self.fail("nothing to repeat")
        return _Repeat(atom, *bounds)

    def quantifier(self, peek: bool = False) -> tuple[int, int | None] | None:
        c = self.peek()
        if c in ("*", "+", "?"):
            if not peek:
                self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        m = _QUANTIFIER.match(self.text, self.i) if c == "{" else None
        if m is None:
            return None
        if peek:
            return (0, None)
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
        if max(lo, hi or 0) > MAX_PATTERN_REPEAT:
            self.fail(f"a repetition count above {MAX_PATTERN_REPEAT:,}")
        if hi is not None and hi < lo:
            self.fail(f"{m.group(0)} is out of order")
        self.i = m.end()
        return lo, hi

    def atom(self) -> Node:
        c = self.peek()
        if c in ("*", "+", "?") or self.quantifier(peek=True) is not None:
            self.fail("nothing to repeat")
        if c == "(":
            return self.group()
        if c == "[":
            return _text(self.char_class())
        self.i += 1
        if c == ".":
            return _text(_DOT)
        if c == "\\":
            found = self.escape(in_class=False)
            return _text(found if isinstance(found, tuple) else ((found, found),))
        return _text(((ord(c), ord(c)),))

    def group(self) -> Node:
        self.i += 1
        if self.peek() == "?":
            if self.peek(1) == ":":
                self.i += 2
            elif self.peek(1) == "<" and self.peek(2) not in ("=", "!"):
                close = self.text.find(">", self.i)
                if close < 0:
                    self.fail("an unterminated group name")
                self.i = close + 1
            else:
                self.fail("lookarounds are not supported")
        self.depth += 1
        node = self.alternation()
        if self.peek() != ")":
            self.fail("an unterminated group")
        self.i += 1
        self.depth -= 1
        return node

    def char_class(self) -> Ranges:
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        pairs: list[tuple[int, int]] = []
        while (c := self.peek()) != "]":
            if not c:
                self.fail("an unterminated '['")
            first = self.class_atom()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                self.i += 1
                last = self.class_atom()
                if isinstance(first, int) and isinstance(last, int):
                    if last < first:
                        self.fail("a class range out of order")
                    pairs.append((first, last))
                    continue
                pairs.append((0x2D, 0x2D))  # a set on either side: '-' is itself
                pairs.extend(((last, last),) if isinstance(last, int) else last)
            pairs.extend(((first, first),) if isinstance(first, int) else first)
        self.i += 1
        found = _ranges(pairs)
        return _complement(found) if negated else found

    def class_atom(self) -> int | Ranges:
        c = self.peek()
        self.i += 1
        return self.escape(in_class=True) if c == "\\" else ord(c)

    def escape(self, in_class: bool) -> int | Ranges:
        """The character or set after a backslash (already read)."""
        c = self.peek()
        self.i += 1
        if not c:
            self.fail("a pattern that ends with a backslash")
        if c.lower() in _SETS:
            found = _SETS[c.lower()]
            return _complement(found) if c.isupper() else found
        if c in _CHARS:
            return _CHARS[c]
        if c == "b" and in_class:
            return 0x08
        if c == "0" and not self.peek().isdigit():
            return 0
        if c in ("x", "u"):
            digits = self.text[self.i : self.i + (2 if c == "x" else 4)]
            if not re.fullmatch(r"[0-9A-Fa-f]{2}" if c == "x" else r"[0-9A-Fa-f]{4}", digits):
                self.fail(f"a malformed \\{c} escape")
            self.i += len(digits)
            return int(digits, 16)
        if c == "c" and self.peek().isascii() and self.peek().isalpha():
            self.i += 1
            return ord(self.text[self.i - 1]) % 32
        if c.isdigit():
            self.fail("backreferences are not supported")
        if c.isascii() and c.isalnum():
            self.fail(f"the escape \\{c} is not supported")
        return ord(c)


def _positions(node: Node) -> int:
    """How many character nodes ``node`` becomes once its repetitions are written out."""
    match node:
        case _Chars():
            return 1
        case _Repeat(inner, lo, hi):
            return _positions(inner) * (hi if hi is not None else lo + 1)
        case _Sequence(parts) | _Choice(parts):
            return sum(_positions(part) for part in parts)


class _Thompson:
    """The pattern's automaton: node ``n`` reads ``chars[n]`` to ``out[n]``, none to ``eps[n]``."""

    def __init__(self) -> None:
        self.chars: list[Ranges | None] = []
        self.out: list[int] = []
        self.eps: list[list[int]] = []

    def node(self, chars: Ranges | None = None) -> int:
        self.chars.append(chars)
        self.out.append(-1)
        self.eps.append([])
        return len(self.chars) - 1

    def build(self, node: Node) -> tuple[int, int]:
        """The start and end nodes of ``node``'s part of the automaton."""
        match node:
            case _Chars(ranges):
                start, end = self.node(ranges), self.node()
                self.out[start] = end
                return start, end
            case _Repeat(inner, lo, hi):
                return self.repeat(inner, lo, hi)
            case _Choice(parts):
                start, end = self.node(), self.node()
                for part in parts:
                    first, last = self.build(part)
                    self.eps[start].append(first)
                    self.eps[last].append(end)
                return start, end
            case _Sequence(parts):
                start = end = self.node()
                for part in parts:
                    first, last = self.build(part)
                    self.eps[end].append(first)
                    end = last
                return start, end

    def repeat(self, inner: Node, lo: int, hi: int | None) -> tuple[int, int]:
        """``lo`` copies, then a loop (no ``hi``) or ``hi - lo`` copies each optional after
        the one before it (``(x(x(x)?)?)?``: one way to read each count)."""
        start = end = self.node()
        for _ in range(lo):
            first, last = self.build(inner)
            self.eps[end].append(first)
            end = last
        if hi is None:
            loop = self.node()
            self.eps[end].append(loop)
            first, last = self.build(inner)
            self.eps[loop].append(first)
            self.eps[last].append(loop)
            return start, loop
        out = self.node()
        for _ in range(hi - lo):
            first, last = self.build(inner)
            self.eps[end] += (first, out)
            end = last
        self.eps[end].append(out)
        return start, out


class _Deterministic:
    """Subset construction: state ``i`` is the set ``members[i]`` of Thompson nodes (those
    with a character, and the end if it is reached), ``moves[i]`` its character ranges
    by the state they lead to. Refused past ``MAX_PATTERN_STATES`` or ``MAX_PATTERN_WORK``.
    """

    def __init__(self, nfa: _Thompson, start: int, end: int, pattern: str) -> None:
        self.nfa, self.end, self.pattern = nfa, end, pattern
        self.work = 0
        self.ids: dict[frozenset[int], int] = {}
        self.members: list[frozenset[int]] = []
        self.moves: list[dict[int, list[tuple[int, int]]]] = []
        self.state(self.closure([start]))
        i = 0
        while i < len(self.members):
            self.expand(i)
            i += 1

    def spend(self, work: int) -> None:
        self.work += work
        if self.work > MAX_PATTERN_WORK:
            raise GrammarError(
                f"the pattern {_shown(self.pattern)} is too ambiguous: its automaton takes more "
                f"than {MAX_PATTERN_WORK:,} steps to build"
            )

    def state(self, members: frozenset[int]) -> int:
        found = self.ids.get(members)
        if found is not None:
            return found
        if len(self.members) >= MAX_PATTERN_STATES:
            raise GrammarError(
                f"the pattern {_shown(self.pattern)} needs more than {MAX_PATTERN_STATES:,} "
                "states to match one way at a time"
            )
        self.ids[members] = len(self.members)
        self.members.append(members)
        self.moves.append({})
        return len(self.members) - 1

    def closure(self, seeds: Iterable[int]) -> frozenset[int]:
        chars, eps, end = self.nfa.chars, self.nfa.eps, self.end
        seen: set[int] = set()
        todo = list(seeds)
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(eps[n])
        self.spend(len(seen))
        return frozenset(n for n in seen if chars[n] is not None or n == end)

    def expand(self, i: int) -> None:
        """The moves of state ``i``: its nodes' ranges cut where any of them begins or ends."""
        chars, out = self.nfa.chars, self.nfa.out
        nodes = sorted(n for n in self.members[i] if chars[n] is not None)
        cuts = sorted({c for n in nodes for lo, hi in chars[n] or () for c in (lo, hi + 1)})
        active: list[list[int]] = [[] for _ in cuts]
        for n in nodes:
            for lo, hi in chars[n] or ():
                a, b = bisect.bisect_left(cuts, lo), bisect.bisect_left(cuts, hi + 1)
                self.spend(b - a)
                for k in range(a, b):
                    active[k].append(n)
        targets: dict[tuple[int, ...], int] = {}
        moves = self.moves[i]
        for k, movers in enumerate(active):
            if movers:
                key = tuple(movers)
                if key not in targets:
                    targets[key] = self.state(self.closure(out[n] for n in movers))
                moves.setdefault(targets[key], []).append((cuts[k], cuts[k + 1] - 1))

    def live(self) -> list[bool]:
        """Whether each state can still reach the end: the others are left out."""
        back: list[list[int]] = [[] for _ in self.members]
        for i, moves in enumerate(self.moves):
            for target in moves:
                back[target].append(i)
        live = [self.end in members for members in self.members]
        todo = [i for i, alive in enumerate(live) if alive]
        while todo:
            for i in back[todo.pop()]:
                if not live[i]:
                    live[i] = True
                    todo.append(i)
        return live


def _class_char(c: int) -> str:
    if c < 0x80 and chr(c).isalnum():
        return chr(c)
    return f"\\x{c:02X}" if c < 0x100 else f"\\u{c:04X}" if c < 0x10000 else f"\\U{c:08X}"


def _gbnf_class(ranges: Ranges) -> str:
    parts = (
        _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}" for lo, hi in ranges
    )
    return "[" + "".join(parts) + "]"


def _gbnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _escape(code: int) -> str:
    """GBNF for what follows the backslash of ``code``'s JSON escape."""
    return _gbnf_literal(_JSON_ESCAPES.get(code, f"u{code:04x}"))


class _Writer:
    """GBNF rules for the live states of ``dfa``, named ``{prefix}-{j}``; the JSON escapes
    of a set of characters (a backslash, then one of them) are a rule ``{prefix}-e{j}``
    shared by every state that takes the same set."""

    def __init__(self, dfa: _Deterministic, prefix: str) -> None:
        self.dfa, self.prefix = dfa, prefix
        self.live = dfa.live()
        moving = [i for i, moves in enumerate(dfa.moves) if any(self.live[t] for t in moves)]
        self.names = {i: f"{prefix}-{j}" for j, i in enumerate(i for i in moving if self.live[i])}
        self.escapes: dict[tuple[int, ...], str] = {}
        self.rules = {self.names[i]: self.state_rule(i) for i in self.names}
        for codes, name in self.escapes.items():
            self.rules[name] = " | ".join(_escape(c) for c in codes)

    def state_rule(self, i: int) -> str:
        """State ``i``'s alternatives: a class of raw characters or a backslash and the
        escapes of some, then the state it leads to (left out where it only ends there)."""
        raw, escaped = [], []
        for target, spans in sorted(self.dfa.moves[i].items()):
            if not self.live[target]:
                continue
            then = f" {self.names[target]}" if target in self.names else ""
            ranges = _ranges(spans)
            plain = _intersect(ranges, _complement(_ESCAPED))
            if plain:
                raw.append(_gbnf_class(plain) + then)
            codes = tuple(c for lo, hi in _intersect(ranges, _ESCAPED) for c in range(lo, hi + 1))
            if len(codes) == 1:
                escaped.append(
                    _gbnf_literal(_JSON_ESCAPES.get(codes[0], f"u{codes[0]:04x}")) + then
                )
            elif codes:
                name = self.escapes.setdefault(codes, f"{self.prefix}-e{len(self.escapes)}")
                escaped.append(name + then)
        if escaped:
            raw.append(f'"\\\\" ({" | ".join(escaped)})')
        body = " | ".join(raw)
        return f"({body})?" if self.dfa.end in self.dfa.members[i] else body


def pattern_rules(pattern: object, name: str, taken: Iterable[str]) -> tuple[str, dict[str, str]]:
    """GBNF for the JSON strings whose value matches ``pattern``, quotes left out: the rule
    that starts it ("" when only the empty string matches) and the rules it needs, named
    after ``name`` unlike any of ``taken``. ``GrammarError`` names a pattern refused."""
    if not isinstance(pattern, str):
        raise GrammarError(f"a pattern is a string, not {type(pattern).__name__}")
    try:
        tree = _Parser(pattern).parse()
        if (positions := _positions(tree)) > MAX_PATTERN_POSITIONS:
            raise GrammarError(
                f"the pattern {_shown(pattern)} is {positions:,} characters long once its "
                f"repetitions are written out (at most {MAX_PATTERN_POSITIONS:,})"
            )
        nfa = _Thompson()
        dfa = _Deterministic(nfa, *nfa.build(tree), pattern)
    except RecursionError:
        raise GrammarError(f"the pattern {_shown(pattern)} nests too deep") from None
    base, k, names = re.sub(r"[^a-zA-Z0-9-]+", "-", name) + "-re", 0, list(taken)
    while any(t.startswith(f"{base}{k or ''}-") for t in names):
        k += 1
    writer = _Writer(dfa, f"{base}{k or ''}")
    if not writer.live[0]:
        raise GrammarError(f"the pattern {_shown(pattern)} matches no string")
    return writer.names.get(0, ""), writer.rules
