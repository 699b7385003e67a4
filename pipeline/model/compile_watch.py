"""A warning in the run's log when `torch.compile` silently stops compiling.

When one function has been recompiled `torch._dynamo.config.recompile_limit` times (8), dynamo
stops compiling it and runs it eagerly for the rest of the process: the run goes on, slower, and
the only trace is a line on torch's own logger that a training log easily hides. `watch_eager_fallbacks`
(installed by `BertLayerStack.compile_layers`) forwards that event to this project's logger as a
warning naming `model.compile` and the function, once per function, and counts it
(`eager_fallbacks`), so a test or a benchmark can assert none happened.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: the dynamo logger that reports a function hitting the recompile limit
DYNAMO_LOGGER = "torch._dynamo.convert_frame"
#: function description -> how many times dynamo reported giving up on it
eager_fallbacks: dict[str, int] = {}


class _FallbackAlarm(logging.Handler):
    """Turns dynamo's "hit config.recompile_limit" record into a warning of ours."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is dynamo's problem, never the run's
            return
        if "hit config." not in message:
            return
        function = next((line.split("function:", 1)[1].strip() for line in message.splitlines()
                         if "function:" in line), "?")
        eager_fallbacks[function] = eager_fallbacks.get(function, 0) + 1
        if eager_fallbacks[function] == 1:
            log.warning("model.compile: torch.compile gave up on %s after too many recompiles and runs it "
                        "eagerly from now on (slower; set TORCH_LOGS=recompiles to see why it recompiled)", function)


_ALARM = _FallbackAlarm(level=logging.WARNING)


def watch_eager_fallbacks() -> None:
    """Install the alarm on dynamo's logger (idempotent)."""
    logger = logging.getLogger(DYNAMO_LOGGER)
    if _ALARM not in logger.handlers:
        logger.addHandler(_ALARM)
