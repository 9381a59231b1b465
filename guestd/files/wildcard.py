"""Globs matched without backtracking: the one matcher behind ``.gitignore`` files, ``file.glob``,
tree include/exclude and watch filters, in linear time.

A glob used to become a Python ``re``; ``*a*a*a*a*a*a*a*a*a*a*a*a*b`` against a name of 200
``a`` then backtracked through every way of sharing the a's among twelve stars, holding the
GIL all along (no timeout, ping or SIGTERM got through). Here a glob is compiled to path
segments, each a list of fixed-size chunks between its ``*``, and matched in two greedy passes
that never go back further than the last star:

- in a segment, each chunk between stars is found at its leftmost place after the previous one
  (``bytes.find`` on its longest literal run, or on a class's 0/1 map made by
  ``bytes.translate``, then the rest checked): the places tried only move forward, so a
  segment costs O(len(name) x len(chunk)), most of it in C;
- over the path, ``**`` is a star whose symbols are whole segments: the classic two-pointer
  wildcard match (on a mismatch, retry one segment further after the last ``**``) tests at most
  (path segments x pattern segments) pairs.

So a match is O(len(path) x len(glob)) at worst, never exponential, and pure Python: it gives
the GIL up like any Python code. A :class:`Budget` bounds it in time as well: the work is
counted and the clock read every :data:`QUANTUM` steps, and :class:`OutOfTime` raised past the
deadline. Compiling is linear too (literal runs are taken whole, an unclosed ``[`` is looked
for once), spends the same budget, and estimates what it holds (:attr:`Compiler.cost`), so a
walk can bound the ``.gitignore`` rules it keeps.

The meaning is exactly that of the ``re`` translation it replaces (kept as the reference of
the equivalence tests, tests/test_workload_patterns.py), over the paths a walk produces (names
joined by ``/``, none empty):

- ``*`` and ``?`` never match ``/``; ``[...]`` is a class (``[!...]``/``[^...]`` negated, a
  ``]`` first is literal, ``a-z`` a range, a backslash literal), never ``/``; ``\\x`` is ``x``;
  a ``[`` without its ``]`` is literal.
- ``**`` between separators (or at an end) crosses them: ``**/`` at the start or ``/**/`` in
  the middle match any directories (none included), ``/**`` (or a lone ``**``) at the end one
  or more names. A ``**`` next to other characters is ``*``.
- anchored globs match the whole path from the base (a leading ``/`` is dropped); unanchored
  ones a path's tail at a name boundary.
"""

from __future__ import annotations

import os
import time

QUANTUM = 50_000  # steps (about one byte compared each) between two looks at the clock
# Estimated bytes a compiled glob holds (on the high side, measured with tracemalloc): per
# atom (a literal run, a class, a '?', a star), per name's glob, per class table, per line.
ATOM_COST, SEGMENT_COST, CLASS_COST, GLOB_COST, REF_COST = 100, 300, 320, 400, 100
CHECK_EVERY = 256  # atoms read between two looks at the budget and the cost bound
SLASH = 0x2F
STAR, QUESTION, OPEN, BACKSLASH = 0x2A, 0x3F, 0x5B, 0x5C
# bytes.translate table: 1 for the bytes that end a literal run in a glob
_SPECIAL = bytes(1 if b in (STAR, QUESTION, OPEN, BACKSLASH, SLASH) else 0 for b in range(256))
_SPECIAL_BUT_OPEN = bytes(0 if b == OPEN else x for b, x in enumerate(_SPECIAL))  # once no ']' follows


class GlobError(ValueError):
    """A glob that does not compile (a reversed range such as ``[z-a]``)."""


class OutOfTime(Exception):
    """A :class:`Budget`'s deadline passed during a match."""


class TooCostly(Exception):
    """What a :class:`Compiler` made would hold more than its ``max_cost``."""


class Budget:
    """What matching may spend: steps are counted and the clock read every ``QUANTUM`` of them,
    so a long match notices its deadline within a few milliseconds. ``deadline`` is a
    ``time.monotonic()`` bound (None: none); :meth:`stop`, from any thread, ends the next match."""

    __slots__ = ("deadline", "left")

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self.left = QUANTUM

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            self.left = QUANTUM
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise OutOfTime

    def stop(self) -> None:
        self.deadline = float("-inf")
        self.left = -1


# --------------------------------------------------------------------------- one segment


class Class:
    """A ``[...]``: ``table[b]`` is 1 where it takes byte ``b`` (a ``bytes.translate`` table)."""

    __slots__ = ("table",)

    def __init__(self, table: bytes) -> None:
        self.table = table


def class_table(body: bytes) -> bytes:
    """The bytes a class body takes (between ``[`` and ``]``, a leading ``!``/``^`` negates), read
    as Python's ``re`` read the old translation: ``x-y`` a range (``-`` first or last literal),
    a ``]`` only first, a backslash and a ``[`` literal. ``/`` is never taken."""
    negate = body[:1] in (b"!", b"^")
    rest = body[1:] if negate else body
    taken = bytearray(256)
    k, n = 0, len(rest)
    while k < n:
        lo = rest[k]
        k += 1
        if k < n and rest[k] == 0x2D:  # '-': a range, or a literal at the end
            if k + 1 >= n:
                taken[lo] = taken[0x2D] = 1
                break
            hi = rest[k + 1]
            k += 2
            if hi < lo:
                raise GlobError(f"bad character range {chr(lo)}-{chr(hi)}")
            taken[lo : hi + 1] = b"\1" * (hi + 1 - lo)
        else:
            taken[lo] = 1
    if negate:
        taken = bytearray(1 - t for t in taken)
    taken[SLASH] = 0
    return bytes(taken)


Atom = bytes | Class | None  # a literal run, a class, or a '?' (any one byte of a name)


class Chunk:
    """A fixed-size run of atoms (between two stars, or a whole name): literal runs and classes
    at their offsets; a ``?`` only takes room."""

    __slots__ = ("anchor", "classes", "literals", "size")

    def __init__(self, atoms: list[Atom]) -> None:
        literals: list[tuple[int, bytes]] = []
        classes: list[tuple[int, bytes]] = []
        off = 0
        for atom in atoms:
            if atom is None:
                off += 1
            elif isinstance(atom, Class):
                classes.append((off, atom.table))
                off += 1
            else:
                literals.append((off, atom))  # runs come whole from the compiler
                off += len(atom)
        self.size = off
        self.literals = tuple(literals)
        self.classes = tuple(classes)
        # the longest literal run: where to look for the chunk with bytes.find
        self.anchor = max(literals, key=lambda lit: len(lit[1])) if literals else None

    def at(self, s: bytes, p: int) -> bool:
        """The chunk matches ``s`` at ``p`` (the caller knows ``p + size <= len(s)``)."""
        for off, lit in self.literals:
            if not s.startswith(lit, p + off):
                return False
        return all(table[s[p + off]] for off, table in self.classes)

    def find(self, s: bytes, start: int, end: int, budget: Budget | None) -> int:
        """The leftmost ``p >= start`` where the chunk matches ``s`` and ends by ``end``; -1 if none.
        The places tried only move forward: O((end - start) x size)."""
        last = end - self.size  # the last place it may start
        if last < start:
            return -1
        if self.anchor is not None:
            off, lit = self.anchor
            where, first, stop = s, start + off, last + off + len(lit)
        else:
            # No literal to look for: the first class's table maps the name to 0/1 bytes, and
            # the places it takes are found in C.
            off, table = self.classes[0]
            lit, where, first, stop = b"\1", s.translate(table), start + off, last + off + 1
        steps = 1 + len(self.literals) + len(self.classes)
        while True:
            i = where.find(lit, first, stop)
            if i < 0:
                return -1
            p = i - off
            if budget is not None:
                budget.spend(steps)
            if self.at(s, p):
                return p
            first = i + 1


Middle = bytes | Class | Chunk | int  # between two stars: a literal, one class, a mixed chunk, or n '?'


class SegmentGlob:
    """The glob of one name that is not a plain literal. Without a star it is one chunk; with
    stars ``h*m1*m2*t`` matches when ``h`` starts the name, ``t`` ends it and ``m1``, ``m2``
    are found in order between them, each at its leftmost place: a later place never leaves
    more room for what follows."""

    __slots__ = ("anything", "head", "middle", "min_len", "prefix", "starred", "suffix", "tail")

    def __init__(self, chunks: list[list[Atom]], starred: bool) -> None:
        """``chunks``: the atoms between stars (the first and last may be empty: a star at the
        start or end); ``starred``: there is at least one star (then ``len(chunks) >= 2``)."""
        self.starred = starred
        self.head = Chunk(chunks[0])
        self.tail = Chunk(chunks[-1]) if starred else None
        middle: list[Middle] = []
        for atoms in chunks[1:-1] if starred else ():
            if not atoms:
                continue  # '**' inside a name is '*'
            if all(a is None for a in atoms):
                middle.append(len(atoms))
            elif len(atoms) == 1 and isinstance(atoms[0], Class):
                middle.append(atoms[0])
            elif all(isinstance(a, bytes) for a in atoms):
                middle.append(b"".join(a for a in atoms if isinstance(a, bytes)))
            else:
                middle.append(Chunk(atoms))
        self.middle = tuple(middle)
        self.min_len = self.head.size + (self.tail.size if self.tail else 0) + sum(map(_size, middle))
        self.anything = starred and self.min_len == 0  # '*'
        # '*' beside a literal: the name's end or start, compared as bytes ('*.pyc', '.#*')
        self.suffix = self.prefix = None
        if starred and not middle and self.tail is not None:
            if not self.head.size and self.tail.size and _plain(self.tail):
                self.suffix = self.tail.literals[0][1]
            elif not self.tail.size and self.head.size and _plain(self.head):
                self.prefix = self.head.literals[0][1]

    def match(self, name: bytes, budget: Budget | None) -> bool:
        n = len(name)
        head = self.head
        if not self.starred:
            return n == head.size and head.at(name, 0)
        if self.anything:
            return True
        if n < self.min_len:
            return False
        if budget is not None:
            budget.spend(len(self.middle))
        tail = self.tail
        assert tail is not None
        pos, end = head.size, n - tail.size
        if (head.size and not head.at(name, 0)) or (tail.size and not tail.at(name, end)):
            return False
        for m in self.middle:
            if isinstance(m, bytes):
                p = name.find(m, pos, end)
                size = len(m)
            elif isinstance(m, int):
                p, size = pos, m
            elif isinstance(m, Class):
                p = name.translate(m.table).find(b"\1", pos, end)
                size = 1
            else:
                p = m.find(name, pos, end, budget)
                size = m.size
            if p < 0 or p + size > end:
                return False
            pos = p + size
        return True


def _size(m: Middle) -> int:
    """Bytes a chunk between stars takes."""
    if isinstance(m, int):
        return m
    if isinstance(m, Class):
        return 1
    return len(m) if isinstance(m, bytes) else m.size


def _plain(chunk: Chunk) -> bool:
    """The chunk is one literal run."""
    return not chunk.classes and len(chunk.literals) == 1 and len(chunk.literals[0][1]) == chunk.size


# --------------------------------------------------------------------------- a path

ANY_DIRS = None  # in a PathGlob's items: zero or more whole segments ('**/')
ANY_NAME = SegmentGlob([[], []], starred=True)  # one segment, whatever it is

Item = bytes | SegmentGlob | None  # a literal name, a name's glob, or ANY_DIRS


class PathGlob:
    """A compiled glob over relative paths (bytes, names joined by ``/``)."""

    __slots__ = ("items", "kind", "last", "literal", "min_len", "source")

    def __init__(self, source: bytes, items: list[Item]) -> None:
        self.source = source
        collapsed: list[Item] = []
        for item in items:
            if item is ANY_DIRS and collapsed and collapsed[-1] is ANY_DIRS:
                continue  # '**/**/' is '**/'
            collapsed.append(item)
        self.items = tuple(collapsed)
        segs = [it for it in collapsed if it is not None]
        # a path holds each segment glob's least bytes and a '/' between two segments
        self.min_len = sum(len(s) if isinstance(s, bytes) else s.min_len for s in segs) + max(len(segs) - 1, 0)
        self.last = segs[-1] if segs else None
        self.literal = b""  # for the kinds compared as bytes
        # The common shapes of .gitignore lines are tested in C (bytes compared), the rest segment by segment.
        last = self.last
        if self.items in ((ANY_NAME, ANY_DIRS), (ANY_DIRS, ANY_NAME, ANY_DIRS)):
            self.kind = "all"  # '**': every path
        elif len(self.items) == 2 and self.items[0] is ANY_DIRS:
            if isinstance(last, bytes) and last:
                self.kind, self.literal = "name_exact", last  # 'node_modules'
            elif isinstance(last, SegmentGlob) and last.suffix:
                self.kind, self.literal = "name_suffix", last.suffix  # '*.pyc'
            elif isinstance(last, SegmentGlob) and last.prefix:
                self.kind, self.literal = "name_prefix", last.prefix  # '.#*'
            else:
                self.kind = "name"  # a name at any depth: only the last segment is looked at
        elif ANY_DIRS not in self.items:
            if all(isinstance(s, bytes) for s in segs):
                self.kind, self.literal = "exact", b"/".join(s for s in segs if isinstance(s, bytes))  # 'docs/_build'
            else:
                self.kind = "fixed"  # as many segments as the glob has, each against its own
        else:
            self.kind = "general"

    def __repr__(self) -> str:
        return f"PathGlob({self.source!r})"

    def match(self, rel: bytes, budget: Budget | None = None) -> bool:
        """Whether ``rel`` matches as a whole (a path relative to the base)."""
        kind = self.kind
        if kind == "name_suffix":
            return rel.endswith(self.literal)  # the suffix holds no '/': it ends the last name
        if kind == "name_exact":
            lit = self.literal
            return rel.endswith(lit) and (len(rel) == len(lit) or rel[-len(lit) - 1] == SLASH)
        if kind == "exact":
            return rel == self.literal
        if kind == "name_prefix":
            return rel.startswith(self.literal, rel.rfind(b"/") + 1)
        if kind == "all":
            return True
        if len(rel) < self.min_len:
            return False
        if kind == "name":
            return _match_item(self.last, rel[rel.rfind(b"/") + 1 :], budget)
        if budget is not None:
            budget.spend(1 + len(rel) // 32)  # the split below
        segs = rel.split(b"/")
        items = self.items
        if kind == "fixed":
            if len(segs) != len(items):
                return False
            return all(_match_item(item, seg, budget) for item, seg in zip(items, segs, strict=True))
        return _match_segments(items, segs, budget)


def _match_item(item: Item, seg: bytes, budget: Budget | None) -> bool:
    if isinstance(item, bytes):
        return seg == item
    assert item is not None
    if budget is not None:
        budget.spend(1)
    return item.match(seg, budget)


def _match_segments(items: tuple[Item, ...], segs: list[bytes], budget: Budget | None) -> bool:
    """The classic greedy wildcard match with ``**`` as the star over whole segments: on a
    mismatch, the last ``**`` takes one more segment and the rest is tried again from there.
    Correct because a later ``**`` can take whatever an earlier one could; at most
    len(items) x len(segs) segment tests."""
    p = s = 0
    star_p, star_s = -1, 0
    n_items, n_segs = len(items), len(segs)
    while s < n_segs:
        if p < n_items:
            item = items[p]
            if item is None:
                star_p, star_s = p, s
                p += 1
                continue
            if _match_item(item, segs[s], budget):
                p += 1
                s += 1
                continue
        if star_p < 0:
            return False
        p = star_p + 1
        star_s += 1
        s = star_s
    while p < n_items and items[p] is None:
        p += 1
    return p == n_items


# --------------------------------------------------------------------------- compiling


class Compiler:
    """Compiles globs; one instance serves a whole ``.gitignore`` so that equal lines, names and
    classes are held once. ``cost`` estimates, in bytes, what everything it compiled holds (on
    the high side); past ``max_cost`` it raises :class:`TooCostly`, having made at most about
    that much. ``budget`` is spent as it reads (a 1 MiB line takes about a second)."""

    def __init__(self, budget: Budget | None = None, max_cost: int | None = None) -> None:
        self.budget = budget
        self.max_cost = max_cost
        self.cost = 0
        self.globs: dict[tuple[bytes, bool], PathGlob] = {}  # by source and anchoring
        self.classes: dict[bytes, Class] = {}  # by body
        self.segments: dict[bytes, Item] = {}  # by source text

    def compile(self, glob: str | bytes, *, anchored: bool) -> PathGlob:
        """``glob`` (without a gitignore ``!`` or trailing ``/``) compiled; ``anchored``: it
        names paths from the base, else a path's tail at any depth. Raises :class:`GlobError`."""
        pat = os.fsencode(glob)
        known = self.globs.get((pat, anchored))
        if known is not None:
            self._charge(REF_COST)
            return known
        source = pat
        if pat.startswith(b"/"):
            pat = pat[1:]
        items: list[Item] = [] if anchored else [ANY_DIRS]
        chunks: list[list[Atom]] = [[]]  # the name being read: its atoms between stars
        run = bytearray()  # the literal run being read ('\x' and an unclosed '[' join it)
        seg_start = 0  # where the name being read starts in pat
        special = pat.translate(_SPECIAL)
        no_close_from = len(pat) + 1  # a '[' from here on has no ']' after it
        i, n = 0, len(pat)
        tokens = 0  # special characters read (the budget is looked at every CHECK_EVERY)
        made = 0  # atoms made in the current name (what it holds before _segment)
        ended = False  # a final '**' took the rest
        while i < n:
            k = special.find(b"\1", i)
            if k < 0:
                k = n
            if k > i:
                run += pat[i:k]  # a literal run, taken whole
                i = k
                continue
            tokens += 1
            if tokens % CHECK_EVERY == 0:  # the name being read holds this much already
                self._check(ATOM_COST * made + len(run))
            c = pat[i]
            if c == STAR:
                if pat.startswith(b"**", i):
                    # a '**' crosses '/' only as a whole segment; elsewhere it is one '*'
                    at_boundary = i == 0 or pat[i - 1] == SLASH
                    after = pat[i + 2 : i + 3]
                    if at_boundary and after == b"/":
                        items.append(ANY_DIRS)  # the name is empty here: a '/' (or the start) just passed
                        i += 3
                        seg_start = i
                        continue
                    if at_boundary and after == b"":
                        items += [ANY_NAME, ANY_DIRS]  # one or more names: everything below
                        ended = True
                        break
                    i += 1
                _flush(run, chunks)
                chunks.append([])
                made += 2
            elif c == QUESTION:
                _flush(run, chunks)
                chunks[-1].append(None)
                made += 1
            elif c == OPEN:
                j = i + 1
                if pat[j : j + 1] in (b"!", b"^"):
                    j += 1
                if pat[j : j + 1] == b"]":
                    j += 1
                close = pat.find(b"]", j) if j < no_close_from else -1
                if close < 0:
                    # No ']' from j on: every later '[' is literal too, and joins a literal run
                    # (looked for once: linear, not once per '[').
                    if j < no_close_from:
                        no_close_from = j
                        special = special[:j] + pat[j:].translate(_SPECIAL_BUT_OPEN)
                    run += b"["
                else:
                    _flush(run, chunks)
                    chunks[-1].append(self._class(pat[i + 1 : close]))
                    made += 1
                    i = close
            elif c == BACKSLASH and i + 1 < n and pat[i + 1] != SLASH:  # '\x' is x
                i += 1
                run += pat[i : i + 1]
            elif c == SLASH or (c == BACKSLASH and i + 1 < n):  # an escaped '/' still separates
                _flush(run, chunks)
                items.append(self._segment(pat[seg_start:i], chunks))
                chunks, made = [[]], 0
                i += c == BACKSLASH
                seg_start = i + 1
            else:
                run += b"\\"  # a lone '\' at the end
            i += 1
        if not ended:
            _flush(run, chunks)
            items.append(self._segment(pat[seg_start:], chunks))
        self._charge(GLOB_COST + len(source) + 8 * len(items))
        glob_ = self.globs[(source, anchored)] = PathGlob(source, items)
        return glob_

    def _charge(self, nbytes: int) -> None:
        """``nbytes`` more are held."""
        self.cost += nbytes
        self._check(0)

    def _check(self, in_flight: int) -> None:
        """Spend the budget; :class:`TooCostly` when what is held and ``in_flight`` pass the bound."""
        if self.budget is not None:
            self.budget.spend(CHECK_EVERY)
        if self.max_cost is not None and self.cost + in_flight > self.max_cost:
            raise TooCostly

    def _class(self, body: bytes) -> Class:
        cls = self.classes.get(body)
        if cls is None:
            self._charge(CLASS_COST + len(body))
            cls = self.classes[body] = Class(class_table(body))
        return cls

    def _segment(self, text: bytes, chunks: list[list[Atom]]) -> Item:
        """One name's glob: a literal name stays bytes; equal texts share one compiled glob."""
        if text in self.segments:
            return self.segments[text]
        item: Item
        if len(chunks) == 1 and all(isinstance(a, bytes) for a in chunks[0]):
            item = b"".join(a for a in chunks[0] if isinstance(a, bytes))
            self._charge(40 + len(item))
        elif len(chunks) > 1 and not any(chunks):
            item = ANY_NAME
        else:
            self._charge(
                SEGMENT_COST + sum(ATOM_COST + (len(a) if isinstance(a, bytes) else 0) for c in chunks for a in c)
            )
            item = SegmentGlob(chunks, len(chunks) > 1)
        self.segments[text] = item
        return item


def _flush(run: bytearray, chunks: list[list[Atom]]) -> None:
    """The literal run read so far becomes an atom of the current chunk."""
    if run:
        chunks[-1].append(bytes(run))
        run.clear()


def compile_glob(glob: str | bytes, *, anchored: bool) -> PathGlob:
    """One glob compiled on its own (see :meth:`Compiler.compile`)."""
    return Compiler().compile(glob, anchored=anchored)
