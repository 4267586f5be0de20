"""``Tunable``: a kernel module's tuning (a frozen dataclass of its walk's sizes and paths), changed for a while by a
context, so that benchmarks and tests never assign the module's constants."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Generic, TypeVar

T = TypeVar("T")


class Tunable(Generic[T]):
    """The tuning in force (``value``); calling it, ``tunable(**changes)``, is a context with those fields changed."""

    def __init__(self, default: T) -> None:
        self.value = default

    @contextmanager
    def __call__(self, **changes) -> Iterator[T]:
        before, self.value = self.value, replace(self.value, **changes)
        try:
            yield self.value
        finally:
            self.value = before
