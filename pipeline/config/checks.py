"""`ConfigError` and the small checks every component's config validation is written with.

A leaf module (it imports nothing of the project), so each component can own its config section
and its validation (`pipeline.model.config`, `pipeline.data.config`, `pipeline.train.config`,
`pipeline.train.optim`, `pipeline.train.engine`, `pipeline.objectives.base`) without importing
the run config that composes them.
"""
from __future__ import annotations

import difflib
import inspect
import math
from typing import Any, Sequence


class ConfigError(ValueError):
    """A configuration problem, reported before any compute; the message names the field or file."""


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """` (did you mean 'x'?)` for the closest option, or an empty string."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known_keys(mapping: dict, keys: Sequence[str], where: str, what: str = "key") -> None:
    """Refuse a mapping's first key not in `keys`: `WHERE.KEY: unknown WHAT (did you mean ...); valid keys: ...`
    (the one rule for the free-form mappings of a config: phases, data.sources entries, data.batch_warmup)."""
    for key in mapping:
        if key not in keys:
            raise ConfigError(f"{where}.{key}: unknown {what}{did_you_mean(str(key), keys)}; valid keys: {', '.join(keys)}")


def check_choice(value: str, options: Sequence[str], where: str) -> None:
    if value not in options:
        raise ConfigError(f"{where}={value!r}: must be one of {list(options)}{did_you_mean(value, options)}")


def check_positive(value: float, where: str, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{where}={value}: must be {'>= 0' if allow_zero else '> 0'}")


def require_number(value: Any, name: str, *, above: float | None = None, at_least: float | None = None,
                   at_most: float | None = None, integer: bool = False, hint: str = "") -> Any:
    """`value` itself when it is a finite number (an `int` when `integer`) within the bounds, else a
    `ValueError` "NAME must be a finite number > 0 and <= 1HINT, got VALUE".

    A component's numeric option is compared with `<` and used in arithmetic: a string from YAML
    (`generator_width: 1/4`) or `null` would otherwise fail with a `TypeError` traceback, `true` would
    pass as 1, and nan / inf would pass range checks written as `value < 0` and turn every loss
    non-finite (or sampling uniform) after compute has started. Raises a plain `ValueError` (not a
    `ConfigError`), so the code that builds the component puts it under its config path
    (`option_error`)."""
    bounds = [f"{op} {bound:g}" for op, bound in ((">", above), (">=", at_least), ("<=", at_most)) if bound is not None]
    want = f"{'an integer' if integer else 'a finite number'}{' ' + ' and '.join(bounds) if bounds else ''}{hint}"
    typed = not isinstance(value, bool) and isinstance(value, int if integer else (int, float))
    if (not typed or not math.isfinite(value) or (above is not None and not value > above)
            or (at_least is not None and not value >= at_least) or (at_most is not None and not value <= at_most)):
        raise ValueError(f"{name} must be {want}, got {value!r}")
    return value


def accepted_keywords(fn: Any, skip: int = 0) -> list[str] | None:
    """Keyword names `fn` (a class or function) accepts after its first `skip` parameters; None = any."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    params = list(inspect.signature(target).parameters.values())
    if inspect.isclass(fn):
        params = params[1:]  # self
    params = params[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def check_keywords(fn: Any, options: dict, where: str, skip: int = 0) -> None:
    """Error naming `where.key` for any option that `fn` (a class or function) does not accept."""
    names = accepted_keywords(fn, skip)
    if names is None:
        return
    for key in options:
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown option{did_you_mean(str(key), names)}; accepted: {names}")


def option_error(where: str, err: Exception, options: Sequence[str]) -> ConfigError:
    """A component's own `ValueError` re-raised under its config path.

    Components say what is wrong in their own terms ("tau must be positive"); the code that
    builds them from the config knows where they live (`objective_options.capt`) and prefixes
    it: `objective_options.capt.tau must be positive` when the message starts with an option
    name, `objective_options.capt: ...` otherwise.
    """
    text = str(err)
    first = text.split(" ", 1)[0].split("=", 1)[0].rstrip(":")
    return ConfigError(f"{where}.{text}" if first in options else f"{where}: {text}")
