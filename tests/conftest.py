"""Shared pytest set-up: the `gpu` marker skips without CUDA; shared tiny-data fixtures live in
`tests/fixtures_data.py` and are re-exported here so every test directory can use them."""
from __future__ import annotations

import os
import signal
import sys
import warnings
from typing import Any, Callable

import pytest
import torch

from tests.gloo_ranks import LAUNCHER_VARIABLES

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:  # the data helper's fixtures (tiny tokenizer, tiny shards)
    from tests.fixtures_data import *  # noqa: F401,F403
except ImportError as err:  # pragma: no cover - only while the module is being written
    if "fixtures_data" not in str(err):
        raise


# `init_distributed` exports these for DeepSpeed; a run inside the pytest process must not leave
# them behind, or a later subprocess (an sbatch job exports the submitter's environment) would take
# the leaked RANK=0 WORLD_SIZE=1 over its launcher's ranks.


@pytest.fixture(autouse=True)
def _restore_launcher_variables():
    before = {name: os.environ.get(name) for name in LAUNCHER_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


class GlobalStateLeak(UserWarning):
    """A test left process-wide state changed; the guard below put it back (the test should itself)."""


#: Signals the pipeline installs handlers for (preemption, requeue, conversion, the shard builder's pool).
GUARDED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP",
                                                            "SIGCONT") if hasattr(signal, name))
#: torch's config modules a test may patch; guarded only once something imported them.
TORCH_CONFIG_MODULES = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
_MISSING = object()


def _config_snapshot() -> dict[str, dict[str, Any]]:
    return {name: sys.modules[name].get_config_copy() for name in TORCH_CONFIG_MODULES if name in sys.modules}


def _restore_config(name: str, saved: dict[str, Any]) -> list[str]:
    """Put back every key of a torch config module that differs from `saved` (or reads as missing, as a
    pytest 9 `monkeypatch.setattr` undo leaves it); keys untouched stay untouched (no new overrides)."""
    module, changed = sys.modules[name], []
    for key, value in saved.items():
        try:
            with warnings.catch_warnings():  # reading a deprecated key warns; the test did not read it
                warnings.simplefilter("ignore")
                current = getattr(module, key)
        except AttributeError:
            current = _MISSING
        try:
            same = current is value or bool(current == value)
        except Exception:  # noqa: BLE001 - a value without a plain truth of equality: compare by identity only
            same = False
        if not same:
            setattr(module, key, value)
            changed.append(f"{name}.{key}")
    return changed


def _torch_flags() -> dict[str, Any]:
    return {"default dtype": torch.get_default_dtype(),
            "deterministic algorithms": (torch.are_deterministic_algorithms_enabled(),
                                         torch.is_deterministic_algorithms_warn_only_enabled()),
            "intra-op threads": torch.get_num_threads()}


_FLAG_SETTERS: dict[str, Callable[[Any], None]] = {
    "default dtype": torch.set_default_dtype,
    "deterministic algorithms": lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1]),
    "intra-op threads": torch.set_num_threads,
}


def snapshot_process_state() -> dict[str, Any]:
    """What `restore_process_state` puts back: torch's flags, the guarded signals' handlers, torch's config."""
    return {"flags": _torch_flags(), "configs": _config_snapshot(),
            "handlers": {sig: signal.getsignal(sig) for sig in GUARDED_SIGNALS}}


def restore_process_state(saved: dict[str, Any]) -> list[str]:
    """Undo every change since `snapshot_process_state`; returns what had changed (empty: nothing)."""
    leaked = []
    for name, value in _torch_flags().items():
        if value != saved["flags"][name]:
            _FLAG_SETTERS[name](saved["flags"][name])
            leaked.append(f"{name} {value} (was {saved['flags'][name]})")
    for sig, handler in saved["handlers"].items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)
            leaked.append(f"handler of {signal.Signals(sig).name}")
    for name, config in saved["configs"].items():
        leaked += _restore_config(name, config)
    return leaked


@pytest.fixture(autouse=True)
def _restore_process_state(request: pytest.FixtureRequest):
    """Whatever a test does, the next one starts from the same process-wide state: torch's default dtype,
    deterministic-algorithm flags and thread count, the handlers of `GUARDED_SIGNALS`, and the keys of
    torch's dynamo / inductor / functorch config. A change found after the test is undone and reported as a
    `GlobalStateLeak` warning naming the test, so an order-dependent outcome (issue 42) cannot arise from it."""
    saved = snapshot_process_state()
    yield
    leaked = restore_process_state(saved)
    if leaked:
        warnings.warn(GlobalStateLeak(f"{request.node.nodeid} left changed (restored): {', '.join(leaked)}"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker, not `"gpu" in item.keywords`: keywords hold every parent node's name too, so a
        # checkout in a folder named `gpu` would skip every test
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
