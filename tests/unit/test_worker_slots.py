"""The worker's attributes stay where CPython specializes access to them.

CPython 3.11 keeps an instance's attributes in values shared with its class for up to 29
names; past that the instance gets a dict of its own, and in a worker's no ``self.method()``
call was specialized (see Worker.__slots__). Worker and Pipeline declare every attribute they
set as a slot, so a worker's __dict__ holds only what its class adds. An attribute added to
either without its slot would land in that dict: these tests say which."""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Any

import pytest

from forkserve.http.parser import RequestParser
from forkserve.workers.base import Worker
from forkserve.workers.gevent import GeventWorker
from forkserve.workers.pipeline import Pipeline
from forkserve.workers.sync import SyncWorker
from forkserve.workers.thread import ThreadWorker

# Attributes CPython 3.11 keeps in shared values (measured: the 30th gives the instance a dict).
SHARED_VALUES_MOST = 29


def assigned(cls: type) -> set[str]:
    """The names ``cls``'s own methods assign on ``self`` (``self.x = ...``, ``self.x += ...``,
    ``self.x, self.y = ...``, annotated or not)."""
    tree = ast.parse(inspect.getsource(sys.modules[cls.__module__]))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            targets = sub.targets
        elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
            targets = [sub.target]
        else:
            continue
        for target in targets:
            for part in ast.walk(target):
                if (isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name)
                        and part.value.id == "self"):
                    names.add(part.attr)
    return names


def slots_of(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in vars(klass).get("__slots__", ())}


def test_the_finder_sees_plain_and_tuple_assignments() -> None:
    names = assigned(Worker)
    assert {"state", "wakeup_r", "wakeup_w", "counters"} <= names


@pytest.mark.parametrize("cls", [Worker, Pipeline])
def test_every_attribute_worker_and_pipeline_set_is_a_slot(cls: type) -> None:
    missing = assigned(cls) - slots_of(cls)
    assert not missing, f"add to {cls.__name__}.__slots__: {sorted(missing)}"


@pytest.mark.parametrize("cls", [SyncWorker, ThreadWorker, GeventWorker],
                         ids=lambda cls: cls.__name__)
def test_what_a_worker_class_adds_fits_in_the_shared_values(cls: type) -> None:
    own = assigned(cls) - slots_of(cls)
    # With room to spare: a hook or a test may set a few more.
    assert len(own) <= SHARED_VALUES_MOST - 4, sorted(own)


def test_the_parser_has_no_dict() -> None:
    """Its attributes are slots: one it sets without declaring fails at once."""
    parser: Any = RequestParser.__new__(RequestParser)
    with pytest.raises(AttributeError):
        parser.undeclared = 1
