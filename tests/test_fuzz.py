"""Property: a store whose metadata (manifest, index files, superblocks,
commit records) is damaged either opens and reads back every byte equal, or
raises a SwarmError; never another exception, an InternalError, a wrong
store or a hang (issue 9; the 10,000-case run is tools/fuzz_store.py)."""

import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools import fuzz_store as FZ


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return FZ.build_base(str(root / "bases")), str(root / "scratch")


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


@pytest.mark.slow
@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(seed=st.integers(0, 2**40))
def test_damaged_metadata_gives_equal_data_or_a_swarm_error(bases, seed):
    base, scratch = bases
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        outcome, kind, detail = FZ.run_case(base, seed, scratch)
    except _Hang:
        pytest.fail(f"case {seed} hung")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert outcome in ("equal", "refused", "skipped"), (seed, outcome, kind, detail)


@pytest.mark.parametrize("kind", FZ.KINDS)
def test_every_kind_of_damage_runs(bases, kind):
    """Each kind of damage, a few seeds: the mutation applies and the result
    is one of the two acceptable outcomes."""
    base, scratch = bases
    seen = 0
    for seed in range(4000):
        import random
        if FZ.KINDS[random.Random(seed).randrange(len(FZ.KINDS))] != kind:
            continue
        outcome, k, detail = FZ.run_case(base, seed, scratch)
        assert k == kind and outcome in ("equal", "refused"), (seed, outcome, detail)
        seen += 1
        if seen == 5:
            break
    assert seen == 5
