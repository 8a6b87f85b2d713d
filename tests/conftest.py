import os

import numpy as np
import pytest

from tools._shared_data import data_dir

ENGINES = ["io_uring", "threads"]

DATA = data_dir()


@pytest.fixture(params=ENGINES)
def engine_kind(request):
    """Runs a test once per engine back end (the conformance suite)."""
    return request.param


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def random_clusters(rng, S, n_clusters, extra_copies=0):
    """A random partition of range(S) into n_clusters non-empty clusters, plus
    ``extra_copies`` replicas sprinkled into random clusters."""
    perm = rng.permutation(S)
    cuts = np.sort(rng.choice(np.arange(1, S), size=n_clusters - 1, replace=False)) \
        if n_clusters > 1 else np.array([], dtype=int)
    clusters = [list(c) for c in np.split(perm, cuts)]
    for t in rng.integers(0, S, size=extra_copies):
        c = int(rng.integers(0, n_clusters))
        if t not in clusters[c]:
            clusters[c].append(int(t))
    return [np.array(c, dtype=np.int64) for c in clusters]


def random_kv(rng, S, H, d, dtype):
    if dtype == "bfloat16":
        import ml_dtypes
        return rng.standard_normal((S, 2, H, d)).astype(np.float32).astype(ml_dtypes.bfloat16)
    return rng.standard_normal((S, 2, H, d)).astype(dtype)


def same_bits(a, b):
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    return a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


def is_root():
    return os.geteuid() == 0
