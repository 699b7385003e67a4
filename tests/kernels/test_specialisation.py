"""One compiled variant per kernel for InfoWord's DIM, whatever its pair count: Triton compiles a
kernel again for every new combination of integer arguments equal to 1 / divisible by 16 and of
pointer alignments (16 bytes), except for the arguments a kernel marks `do_not_specialize`. DIM's
pairs (and, with global negatives, the other ranks' n-grams: the queue) change every micro-batch,
so a launch whose class follows them costs a compilation (about a second of host time on the
GPU) each time a new class shows up - inside the timed steps of the first lease's InfoWord rows.

Every launch of the sequence-InfoNCE kernels is recorded (under the interpreter here, compiled on
a GPU) and its specialisation key computed by Triton's rule; the key must be one per kernel and
flag set (constexprs, dtypes) across pair counts 5 ... 33 and queue sizes 0 ... 20.
"""
from __future__ import annotations

import pytest
import torch

from pipeline.kernels import linear_cross_entropy as lce
from pipeline.kernels import sequence_contrastive as seq

KERNELS = {"scores": seq._scores_kernel, "matmul": seq._scaled_matmul_kernel, "norms": seq._row_norms_kernel,
           "rows": lce._softmax_xent_rows_kernel}


def not_specialised(kernel) -> set[str]:
    """Names of the arguments the kernel's `do_not_specialize` lists (the JIT and the interpreter keep it apart)."""
    listed = getattr(kernel, "do_not_specialize", None)
    if listed is None:
        listed = getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    names = kernel.arg_names
    return {names[i] if isinstance(i, int) else i for i in listed}


def specialisation_key(kernel, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """What Triton keys a compiled variant on, as (the launch's flags: constexprs and tensor dtypes,
    which a caller picks on purpose; the classes its data sets: each tensor's 16-byte alignment and
    each integer's 1 / divisible-by-16 class, unless not specialised)."""
    skip = not_specialised(kernel)
    bound = dict(zip(kernel.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
    flags, classes = [], []
    for name in kernel.arg_names:
        value = bound[name]
        if isinstance(value, torch.Tensor):
            flags.append((name, str(value.dtype)))
            classes.append((name, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or not isinstance(value, int):
            flags.append((name, value if isinstance(value, (bool, str)) else type(value).__name__))
        elif name not in skip:
            classes.append((name, "1" if value == 1 else "D" if value % 16 == 0 else ""))
    return tuple(flags), tuple(classes)


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, launch flags) -> set of the data-set classes of every such launch (a launch site's
    own choices, e.g. the gradient matmul reading the scores transposed, are variants compiled once)."""
    seen: dict[tuple, set] = {}
    for name, kernel in KERNELS.items():
        run = kernel.run

        def recording(*args, _name=name, _kernel=kernel, _run=run, **kwargs):
            flags, classes = specialisation_key(_kernel, args, kwargs)
            seen.setdefault((_name, flags), set()).add(classes)
            return _run(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", recording)
    return seen


def dim_loss(device, pairs: int, queue: int, dim: int = 32) -> None:
    """InfoWord's DIM call (`infoword.dim_contrastive_loss`): sentences[owner] against their n-grams,
    dot scores, one direction, no same-view negatives, groups = the sentence; `queue` remote n-grams."""
    gen = torch.Generator().manual_seed(pairs * 100 + queue)
    owner = torch.arange(pairs) // 2
    sentences = torch.randn(pairs, dim, generator=gen).to(device).requires_grad_()
    ngrams = torch.randn(pairs, dim, generator=gen).to(device).requires_grad_()
    remote = torch.randn(queue, dim, generator=gen).to(device) if queue else None
    loss = seq.sequence_contrastive_loss(sentences, ngrams, 1.0, remote, normalize=False, symmetric=False,
                                         same_view_negatives=False, groups=owner.to(device))
    loss.backward()


def test_dim_compiles_each_kernel_once_whatever_the_pair_and_queue_counts(device, launches):
    """The variants one micro-batch compiles (17 pairs, 3 queue rows: every launch site of the forward and
    backward) are all that any other pair and queue count asks for."""
    dim_loss(device, 17, 3)
    first = {key: set(classes) for key, classes in launches.items()}
    assert {name for name, _ in first} == set(KERNELS)
    for pairs, queue in ((5, 0), (8, 0), (16, 0), (24, 16), (33, 20), (32, 0), (64, 1)):
        dim_loss(device, pairs, queue)
    for key, classes in launches.items():
        assert classes == first.get(key), f"{key[0]}: new variants {sorted(classes - first.get(key, set()))}"


def test_the_padding_columns_change_no_value(device):
    """The padded score buffer gives the reference's loss and gradients at a pair count and queue that
    are not multiples of 16 (the kernel tests compare the rest of the grid)."""
    from pipeline.kernels import functional as ref
    from tests.kernels.helpers import assert_matches

    gen = torch.Generator().manual_seed(3)
    a, b, q = (torch.randn(n, 24, generator=gen).to(device) for n in (13, 13, 7))
    groups = (torch.arange(13) // 3).to(device)
    kwargs = dict(normalize=False, symmetric=False, same_view_negatives=False, groups=groups)
    assert_matches(lambda x, y: ref.sequence_contrastive_loss(x, y, 2.0, q, **kwargs),
                   lambda x, y: seq.sequence_contrastive_loss(x, y, 2.0, q, **kwargs), [a, b], [0, 1])
