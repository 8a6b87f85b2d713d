"""What the test modules share: the engine parametrisation, seeded random
stores, the real MiniLM layer (captured once per session), the
poll-with-deadline helper (tests never sleep a fixed time) and the
unit/integration split (``pytest -m unit``, ``pytest -m integration``)."""

import os
import threading
import time

import numpy as np
import pytest

from tools._shared_data import data_dir

ENGINES = ["io_uring", "threads"]

DATA = data_dir()
WIKI = DATA / "wikitext2_raw_test.raw"

#: Test modules that run the system end to end: real stores on their disks
#: through the whole storage path, the FUSE mount, the real model, the command
#: lines in subprocesses.  Every other module is ``unit``; a test marked
#: ``model``, ``fuse`` or ``root`` is ``integration`` wherever it lives.
INTEGRATION = {
    "test_baseline_appends",    # decoding through transformers and the store after appends
    "test_bench_smoke",         # the evaluation benchmarks, run end to end
    "test_capture",             # Q/K/V capture from real transformers
    "test_cli",                 # the swarmfs command line in subprocesses
    "test_demo",                # the demo on the real model
    "test_disks",               # FIFOs, directories, devices and loops as disks
    "test_engine",              # io_uring and threads on real disk files
    "test_executor",            # batched reads and damage location on real disks
    "test_format",              # the on-disk format of real stores
    "test_fuse",                # real mounts
    "test_fuse_isolation",      # stuck disks under a real mount
    "test_fuzz",                # damaged stores, opened and read end to end
    "test_generate",            # swarmfs generate: CLI and model
    "test_hf",                  # SwarmCache under transformers, on a store
    "test_hf_batch",            # batched SwarmCache under transformers, on stores
    "test_model",               # the trained decoder
    "test_store",               # store round trips and failure modes
    "test_suite",               # the long-context suite end to end
    "test_testbed",             # loop devices, cgroups, fio
    "test_tools",               # the developer tools' command lines
}
_INTEGRATION_MARKS = {"model", "fuse", "root"}


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


@pytest.fixture
def each_path():
    """Every kernel path this CPU supports, scalar first; the automatic
    choice is restored afterwards."""
    from swarmfs.store._kernels import set_kernel_path, supported_paths
    paths = supported_paths()
    assert paths[0] == "scalar"
    yield paths
    set_kernel_path("auto")


def replicated_csr(rng, C, extra=200):
    """Clusters of 1-8 members over S tokens, the last also holding ``extra``
    replicas: (ptr int64 [C+1], members int32 [M], S)."""
    sizes = rng.integers(1, 9, C)
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    S = int(ptr[-1])
    members = np.concatenate([rng.permutation(S), rng.integers(0, S, extra)])
    ptr[-1] = members.shape[0]
    return ptr, members.astype(np.int32), S


def random_kv(rng, S, H, d, dtype):
    if dtype == "bfloat16":
        import ml_dtypes
        return rng.standard_normal((S, 2, H, d)).astype(np.float32).astype(ml_dtypes.bfloat16)
    return rng.standard_normal((S, 2, H, d)).astype(dtype)


def random_layer_store(path, rng, *, S, H, HQ, D, disks, clusters, extra_copies=0, hot=(),
                       **write):
    """A one-layer float16 store of random KV (``random_kv``) in random
    replicated clusters (``random_clusters``), clusters ``hot`` marked hot,
    written with ``write_layer(**write)``: (store, kv, clusters)."""
    from swarmfs import Store
    s = Store.create(path, disks=disks, num_layers=1, num_kv_heads=H, head_dim=D,
                     num_query_heads=HQ, dtype="float16")
    kv = random_kv(rng, S, H, D, "float16")
    cl = random_clusters(rng, S, clusters, extra_copies)
    mask = np.zeros(clusters, bool)
    mask[list(hot)] = True
    s.write_layer(0, kv, cl, hot=mask, **write)
    return s, kv, cl


def same_bits(a, b):
    a = np.ascontiguousarray(a)
    b = np.ascontiguousarray(b)
    return a.shape == b.shape and a.view(np.uint8).tobytes() == b.view(np.uint8).tobytes()


def is_root():
    return os.geteuid() == 0


def wait_until(pred, timeout: float = 10.0, what: str = "the condition",
               interval: float = 0.005):
    """Poll ``pred()`` until it returns a true value and return that value.

    The one way tests wait for something another thread or process does: no
    fixed sleeps; ``interval`` only yields the CPU between polls.

    Raises:
        AssertionError: ``timeout`` seconds passed first (names ``what``).
    """
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def minilm_layer2():
    """MiniLM layer 2 over 2304 tokens of real text (WikiText-2, else stdlib
    docstrings): q [12, 2304, 32], k [12, 2304, 32] fp32 and the softmax
    scaling.  Captured once per session; capture windows start at 0, so a
    prefix of it is the capture of that prefix."""
    pytest.importorskip("torch")
    from swarmfs.layout._capture import capture, read_text, stdlib_text
    text = read_text(WIKI, max_chars=30_000) if WIKI.is_file() else stdlib_text(30_000)
    cap = capture(text=text, max_tokens=2304, layers=[2], progress=False)
    return cap.q[0], cap.k[0], cap.scaling


def run_in_threads(work, n: int, *, poll=None, timeout: float = 120) -> list:
    """Run ``work(k)`` for k in range(n), on n threads at once; ``poll()`` is
    called in a loop while any runs.  Returns what went wrong: the repr of
    each exception a thread raised, and each thread still running after
    ``timeout`` seconds (a hang is a failure, not a stuck test)."""
    errors = []

    def wrapped(k):
        try:
            work(k)
        except Exception as exc:   # reported to the caller
            errors.append(repr(exc))
    threads = [threading.Thread(target=wrapped, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    if poll is not None:
        while any(t.is_alive() for t in threads):
            poll()
    for t in threads:
        t.join(timeout)
    return errors + [f"thread {k} still running after {timeout} s"
                     for k, t in enumerate(threads) if t.is_alive()]


def pytest_collection_modifyitems(config, items):
    """Mark every test ``unit`` or ``integration`` (see :data:`INTEGRATION`)."""
    for item in items:
        end_to_end = item.path.stem in INTEGRATION or \
            any(m.name in _INTEGRATION_MARKS for m in item.iter_markers())
        item.add_marker(pytest.mark.integration if end_to_end else pytest.mark.unit)
