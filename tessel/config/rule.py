"""A rule that ties a recipe's sections together: the field it names, what must hold, and what a recipe
that breaks it is told (tessel.config.rules holds them, one file per strategy; tessel.config.check runs them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar

from tessel.errors import ConfigError

T = TypeVar("T")
S = TypeVar("S")


@dataclass(frozen=True)
class Rule(Generic[T]):
    """Where `when(cfg)` (always, when None), `holds(cfg)` must be true, or the recipe is refused with
    ConfigError(field, message). field and message are text, or functions of the config for the rules
    whose text quotes its values."""

    field: str | Callable[[T], str]
    holds: Callable[[T], bool]
    message: str | Callable[[T], str]
    when: Callable[[T], bool] | None = None

    def broken_by(self, cfg: T) -> bool:
        return (self.when is None or self.when(cfg)) and not self.holds(cfg)

    def error(self, cfg: T) -> ConfigError:
        field = self.field(cfg) if callable(self.field) else self.field
        message = self.message(cfg) if callable(self.message) else self.message
        return ConfigError(field, message)


def check_rules(rules: Iterable[Rule[T]], cfg: T) -> None:
    """Raise the error of the first rule `cfg` breaks, in the order given."""
    for rule in rules:
        if rule.broken_by(cfg):
            raise rule.error(cfg)


def on_part(part: Callable[[S], T], rules: Iterable[Rule[T]]) -> list[Rule[S]]:
    """Rules written for a section (a DataConfig), checked on the whole config: `part` picks the section."""
    def lift(f):
        return f if f is None or not callable(f) else (lambda cfg: f(part(cfg)))
    return [Rule(lift(r.field), lift(r.holds), lift(r.message), lift(r.when)) for r in rules]
