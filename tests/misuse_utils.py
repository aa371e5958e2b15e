"""The misuse-table runners shared by the test modules (docs/spec.md section 14).

Each test module keeps the misuse cases of the object it misuses, next to that object's other
tests, in one of two table forms:

* ``(id, call, exception type, words)``: ``call()`` must raise the exception type (or a
  subclass), with a message that contains every word as a token of its own. Run with
  :func:`assert_raises_naming` (one parametrized test per case) and
  :func:`assert_every_case_refused_by_tpamp` (one meta-check per table: ids distinct, and every
  case refused inside the tpamp package itself).
* :class:`Case` (``setup()`` -> picture, bad call): the call must raise exactly the type, name
  the words, and leave the picture (bytes of everything it must not touch) unchanged. Run with
  :func:`assert_refused_and_unchanged` and :func:`assert_every_setup_case_refused_by_tpamp`.

:func:`refused_construction` checks a refused wrapper construction left the inner optimizer
as it was."""

from __future__ import annotations

import os
import re
import traceback

import pytest
from dist_utils import freeze, tensor_bytes

import tpamp

#: Sentinel for "remove this key" in the state-dict editors of the tables.
DROP = object()


def case_ids(cases):
    """The ids of a table's cases, for ``pytest.mark.parametrize(ids=...)``."""
    return [c[0] for c in cases]


def words_pattern(words):
    """Regex: every word present as a token of its own (not part of a longer identifier)."""
    return "(?s)" + "".join(rf"(?=.*(?<![\w]){re.escape(w)}(?![\w]))" for w in words)


def all_of(*words) -> str:
    """Regex matching a message that contains every one of ``words`` (regexes themselves) as a
    separate token."""
    return "(?s)" + "".join(rf"(?=.*(?<![\w.]){w}(?![\w]))" for w in words)


def assert_raises_naming(case_id, call, exc, words):
    """``call()`` raises ``exc`` (or a subclass) whose message contains every word of ``words``.
    A KeyError's message is its first argument (``str()`` would add quotes)."""
    with pytest.raises(exc) as info:
        call()
    assert type(info.value) is exc or exc in type(info.value).__mro__
    msg = info.value.args[0] if isinstance(info.value, KeyError) and info.value.args else str(info.value)
    assert re.search(words_pattern(words), str(msg)), f"{case_id}: {words} not all in: {msg}"


def assert_every_case_refused_by_tpamp(cases):
    """The table's ids are distinct (so ``-k`` selects one case), and the innermost frame of
    each case's exception is in the tpamp package: tpamp refuses the input itself, rather than
    the case's own builder (a broken lambda raising the expected type would otherwise pass) or
    torch further down."""
    ids = case_ids(cases)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    package = os.path.dirname(os.path.abspath(tpamp.__file__)) + os.sep
    elsewhere = {}
    for case_id, call, exc, _ in cases:
        try:
            call()
        except exc as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            if not os.path.abspath(frame.filename).startswith(package):
                elsewhere[case_id] = f"{frame.filename}:{frame.lineno}"
        else:
            elsewhere[case_id] = "nothing raised"
    assert not elsewhere, elsewhere


# ---- tables of cases with a setup: refused, and nothing changed ------------------------------


class Case:
    """One misuse: ``setup()`` -> (picture, the bad call). ``picture()`` returns a comparable
    picture (bytes) of everything the refusal must leave alone."""

    def __init__(self, cid, setup, exc, words):
        self.id, self.setup, self.exc, self.words = cid, setup, exc, words


def assert_refused_and_unchanged(case):
    """The bad call raises exactly ``case.exc``, with a message that contains every word, and
    the picture taken before the call is the picture after it."""
    picture, call = case.setup()
    before = picture()
    with pytest.raises(case.exc) as info:
        call()
    assert type(info.value) is case.exc, type(info.value)
    msg = info.value.args[0] if isinstance(info.value, KeyError) and info.value.args else str(info.value)
    assert re.search(words_pattern(case.words), str(msg)), f"{case.id}: {case.words} not all in: {msg}"
    assert picture() == before, f"{case.id}: the refusal changed state"


def assert_every_setup_case_refused_by_tpamp(cases, other_ids=()):
    """As :func:`assert_every_case_refused_by_tpamp` for a table of :class:`Case`; the ids are
    also distinct from ``other_ids`` (another table's ids)."""
    ids = [c.id for c in cases] + list(other_ids)
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    package = os.path.dirname(os.path.abspath(tpamp.__file__)) + os.sep
    elsewhere = {}
    for case in cases:
        _, call = case.setup()
        try:
            call()
        except case.exc as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            if not os.path.abspath(frame.filename).startswith(package):
                elsewhere[case.id] = f"{frame.filename}:{frame.lineno}"
        else:
            elsewhere[case.id] = "nothing raised"
    assert not elsewhere, elsewhere


# ---- a refused construction leaves the inner optimizer as it was ---------------------------


def _inner_picture(inner, params):
    return ([tensor_bytes(p) for p in params], freeze(inner.state_dict()))


def refused_construction(build, inner, params, exc, words):
    """``build()`` raises ``exc`` with every word in its message, and leaves the inner torch
    optimizer as it was: its params' bytes, its state dict, and not marked as wrapped."""
    from tpamp._guards import wrapped_by

    before = _inner_picture(inner, params)
    with pytest.raises(exc) as info:
        build()
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    assert _inner_picture(inner, params) == before and wrapped_by(inner) is None
    return str(info.value)


def set_in(path, value):
    """A state-dict edit for the load tables: ``sd[path[0]][path[1]]... = value`` (or
    ``value(old)`` when ``value`` is callable); returns the edited ``sd``."""
    def edit(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
        return sd
    return edit
