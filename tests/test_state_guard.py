"""The suite's process-state guard (`tests/conftest.py`): what one test changes process-wide is put back
before the next, so no outcome depends on the order (issue 42; `pytest -p randomly`)."""
from __future__ import annotations

import signal

import pytest
import torch
import torch._dynamo

from tests.conftest import restore_process_state, snapshot_process_state


def test_every_guarded_change_is_undone_and_named() -> None:
    config = torch._dynamo.config
    limit, dtype, threads = config.recompile_limit, torch.get_default_dtype(), torch.get_num_threads()
    handler = signal.getsignal(signal.SIGTERM)
    saved = snapshot_process_state()
    try:
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True, warn_only=True)
        signal.signal(signal.SIGTERM, lambda *_: None)
        with pytest.MonkeyPatch.context() as patch:  # pytest 9's undo of this deletes the key from torch's config
            patch.setattr(config, "recompile_limit", limit + 7)
        config.automatic_dynamic_shapes = not config.automatic_dynamic_shapes
    finally:
        leaked = restore_process_state(saved)
    text = ", ".join(leaked)
    assert "default dtype torch.float64" in text and "deterministic algorithms (True, True)" in text
    assert "handler of SIGTERM" in text and "torch._dynamo.config.automatic_dynamic_shapes" in text
    assert torch.get_default_dtype() == dtype and not torch.are_deterministic_algorithms_enabled()
    assert signal.getsignal(signal.SIGTERM) is handler and torch.get_num_threads() == threads
    assert config.recompile_limit == limit  # readable again, whatever the undo left
    assert restore_process_state(snapshot_process_state()) == []  # nothing changed: nothing reported
