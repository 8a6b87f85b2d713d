"""Properties of the pure read planner (SWARM §6.1, eq. 8)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmfs import plan_reads


def simulate(plan, disks_mem):
    """Execute a plan against in-memory disk images (no I/O): staging buffer."""
    buf = np.zeros(plan.staging_bytes, dtype=np.uint8)
    for d, o, n, t in zip(plan.disk, plan.offset, plan.length, plan.dst, strict=True):
        buf[t:t + n] = disks_mem[d][o:o + n]
    return buf


@st.composite
def layouts(draw):
    """Random copies of tokens on disks: each token has 1..ndisks copies at
    distinct slots; entry size and block size vary."""
    ndisks = draw(st.integers(1, 6))
    ntok = draw(st.integers(1, 60))
    E = draw(st.sampled_from([64, 96, 512, 1536, 4096]))
    bs = draw(st.sampled_from([512, 4096]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    copies = rng.integers(1, ndisks + 1, size=ntok)
    tok = np.repeat(np.arange(ntok), copies)
    disk = np.concatenate([rng.choice(ndisks, size=c, replace=False) for c in copies])
    # slots: per disk, a random permutation of positions (some gaps)
    off = np.zeros(tok.shape[0], dtype=np.uint64)
    for d in range(ndisks):
        idx = np.flatnonzero(disk == d)
        slots = rng.choice(len(idx) * 2 + 1, size=len(idx), replace=False)
        off[idx] = 4096 + slots.astype(np.uint64) * np.uint64(E)
    want = draw(st.lists(st.integers(0, ntok - 1), min_size=1, max_size=80))
    gap = draw(st.sampled_from([0, 0, E, 4 * E]))
    return ndisks, E, bs, tok, disk, off, np.array(want), gap


def build_disks(ndisks, E, tok, disk, off, rows):
    size = int(off.max()) + E + 8192 if off.size else 8192
    mem = [np.zeros(size, dtype=np.uint8) for _ in range(ndisks)]
    for t, d, o in zip(tok, disk, off, strict=True):
        mem[d][o:o + E] = rows[t]
    return mem


@settings(max_examples=150, deadline=None)
@given(layouts(), st.sampled_from(["balanced", "first"]))
def test_plan_reads_every_wanted_entry_once_and_correctly(layout, policy):
    ndisks, E, bs, tok, disk, off, want, gap = layout
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 256, size=(tok.max() + 1, E), dtype=np.uint8)
    mem = build_disks(ndisks, E, tok, disk, off, rows)
    sel = np.isin(tok, want)
    plan = plan_reads(tok[sel], disk[sel], off[sel], ndisks=ndisks, entry_bytes=E,
                      block_size=bs, max_gap=gap, policy=policy)
    # dedup: each wanted token exactly once, sorted
    assert list(plan.tokens) == sorted(set(want.tolist()))
    # requests are block aligned, per disk non-overlapping
    assert (plan.offset % bs == 0).all() and (plan.length % bs == 0).all()
    for d in range(ndisks):
        m = plan.disk == d
        o, n = plan.offset[m], plan.length[m].astype(np.uint64)
        order = np.argsort(o)
        assert (o[order][1:] >= (o + n)[order][:-1]).all()
    # staging layout is contiguous
    assert plan.staging_bytes == int(plan.length.sum())
    # the bytes at src are the entries' bytes
    buf = simulate(plan, mem)
    for t, s in zip(plan.tokens, plan.src, strict=True):
        assert (buf[s:s + E] == rows[t]).all()
    # the chosen copy is a copy of that token
    assert (tok[sel][plan.copy] == plan.tokens).all()
    assert plan.disk_entries.sum() == plan.tokens.shape[0]
    # no more requests than entries
    assert plan.num_requests <= plan.num_entries


def test_no_dedup_reads_every_copy():
    tok = np.array([0, 0, 1, 1, 1])
    disk = np.array([0, 1, 0, 1, 2])
    off = np.array([4096, 4096, 8192, 8192, 4096], dtype=np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=3, entry_bytes=4096, block_size=4096,
                      dedup=False)
    assert plan.num_entries == 5 and plan.num_requests == 3  # adjacent copies coalesce
    assert plan.disk_bytes.sum() == 5 * 4096


def test_balance_when_every_entry_is_everywhere():
    """Fully replicated entries spread evenly: bucket sizes differ by <= 1."""
    n, N = 1001, 4
    tok = np.repeat(np.arange(n), N)
    disk = np.tile(np.arange(N), n)
    off = (tok * 4096 + 4096).astype(np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=N, entry_bytes=4096, block_size=4096)
    assert plan.disk_entries.max() - plan.disk_entries.min() <= 1


def test_single_copy_entries_go_to_their_disk_first():
    """Single-copy entries fill their buckets before replicated ones choose."""
    # tokens 0..5 only on disk 0; tokens 6..9 on disk 0 or 1
    tok = np.array([0, 1, 2, 3, 4, 5, 6, 6, 7, 7, 8, 8, 9, 9])
    disk = np.array([0] * 6 + [0, 1] * 4)
    off = np.arange(tok.shape[0], dtype=np.uint64) * 4096
    plan = plan_reads(tok, disk, off, ndisks=2, entry_bytes=4096, block_size=4096)
    assert list(plan.disk_entries) == [6, 4]
    static = plan_reads(tok, disk, off, ndisks=2, entry_bytes=4096, block_size=4096,
                        policy="first")
    assert list(static.disk_entries) == [10, 0]


def test_adjacent_entries_coalesce_and_requests_interleave():
    E = 4096
    # disk 0: 10 adjacent entries; disk 1: 10 entries with one-entry gaps
    tok = np.arange(20)
    disk = np.array([0] * 10 + [1] * 10)
    off = np.concatenate([np.arange(10) * E, np.arange(10) * 2 * E]).astype(np.uint64)
    plan = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096)
    assert (plan.disk == 0).sum() == 1 and (plan.disk == 1).sum() == 10
    assert list(plan.disk[:2]) == [0, 1]  # round-robin: head of each bucket first
    gapped = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096,
                        max_gap=E)
    assert gapped.num_requests == 2
    capped = plan_reads(tok, disk, off, ndisks=2, entry_bytes=E, block_size=4096,
                        max_request=4 * E)
    assert (capped.disk == 0).sum() == 3


def test_small_entries_sharing_a_block_merge():
    E = 128
    tok = np.arange(4)
    disk = np.zeros(4, dtype=int)
    off = np.array([0, 256, 1024, 1152], dtype=np.uint64)  # two pairs in one block each
    plan = plan_reads(tok, disk, off, ndisks=1, entry_bytes=E, block_size=512)
    assert plan.num_requests == 2
    plan4k = plan_reads(tok, disk, off, ndisks=1, entry_bytes=E, block_size=4096)
    assert plan4k.num_requests == 1 and plan4k.staging_bytes == 4096


def test_bad_arguments():
    with pytest.raises(ValueError):
        plan_reads([0], [0], [0], ndisks=1, entry_bytes=512, block_size=512, policy="x")
    with pytest.raises(ValueError):
        plan_reads([0], [0, 1], [0], ndisks=1, entry_bytes=512, block_size=512)
    empty = plan_reads([], [], [], ndisks=2, entry_bytes=512, block_size=512)
    assert empty.num_requests == 0 and empty.staging_bytes == 0


def test_bad_plan_arguments_are_invalid_argument_errors():
    from swarmfs._errors import InvalidArgumentError
    ok = dict(ndisks=2, entry_bytes=64, block_size=512)
    tok, disk, off = np.array([0, 1]), np.array([0, 1]), np.array([0, 64], np.uint64)
    for args, kw in (((tok, disk, off[:1]), {}),                            # lengths
                     ((tok, np.array([0, 2]), off), {}),                     # disk 2 of 2
                     ((tok, np.array([0, -1]), off), {}),
                     ((tok, disk, np.array([0, -64])), {}),                  # negative offset
                     ((np.array([0.0, 1.0]), disk, off), {}),                # float tokens
                     ((tok, disk, off), {"block_size": 300}),
                     ((tok, disk, off), {"ndisks": 0}),
                     ((tok, disk, off), {"entry_bytes": 1.5}),
                     ((tok, disk, off), {"max_request": 0}),
                     ((tok, disk, off), {"max_gap": -1})):
        with pytest.raises(InvalidArgumentError):
            plan_reads(*args, **{**ok, **kw})


# -- the numpy planner the C one replaced: the executable specification ----------

from swarmfs.store._kernels import assign_buckets  # noqa: E402
from swarmfs.store._planner import MAX_REQUEST, Plan  # noqa: E402


def _ref_choose_copies(tok: np.ndarray, cdisk: np.ndarray, ndisks: int, policy: str):
    """Dedup + bucket assignment.  Returns (unique sorted tokens, chosen copy idx)."""
    m = tok.shape[0]
    # sort (token, candidate index) pairs packed in one int64: a value sort is
    # several times faster than a stable argsort and keeps candidate order
    key = (tok << np.int64(32)) | np.arange(m, dtype=np.int64)
    key.sort()
    order = key & np.int64(0xFFFFFFFF)
    tok_s = key >> np.int64(32)
    first = np.empty(m, dtype=bool)
    first[0] = True
    np.not_equal(tok_s[1:], tok_s[:-1], out=first[1:])
    u_start = np.flatnonzero(first)
    utok = tok_s[u_start]
    if u_start.shape[0] == m or policy == "first":
        # every token has one candidate (or static routing): take the first
        return utok, order[u_start]
    ucount = np.diff(np.append(u_start, m))
    chosen = order[u_start]                 # single-copy entries: their only copy
    multi = np.flatnonzero(ucount > 1)
    # single-copy entries fill their buckets first; the rest, in ascending copy
    # count, go to the smallest bucket among their copies (C, sequential greedy)
    first_disk = cdisk[chosen]
    load = np.bincount(first_disk, weights=ucount == 1, minlength=ndisks).astype(np.int64)
    mc = ucount[multi]
    porder = multi[np.argsort(mc.astype(np.uint8 if mc.max() < 256 else np.int64),
                              kind="stable")]     # radix sort on small counts
    cnt_p = ucount[porder]
    ptr = np.zeros(porder.shape[0] + 1, dtype=np.int64)
    np.cumsum(cnt_p, out=ptr[1:])
    rep = np.repeat(u_start[porder] - ptr[:-1], cnt_p) + np.arange(int(ptr[-1]))
    cand = order[rep]                       # candidate copies, in processing order
    choice, _ = assign_buckets(ptr, cdisk[cand], ndisks, load)
    chosen[porder] = cand[choice]
    return utok, chosen



def reference_plan(tok, cdisk, coff, *, ndisks, entry_bytes, block_size, max_gap=0,
                   max_request=MAX_REQUEST, policy="balanced", dedup=True):
    tok = np.asarray(tok, np.int64)
    cdisk = np.asarray(cdisk, np.int32)
    coff = np.asarray(coff, np.uint64)
    E = int(entry_bytes)
    zeros = np.zeros(ndisks, dtype=np.int64)
    if tok.shape[0] == 0:
        e64, eu = np.empty(0, np.int64), np.empty(0, np.uint64)
        return Plan(np.empty(0, np.int32), eu, np.empty(0, np.uint32), eu, 0,
                    e64, eu, e64, zeros, zeros.copy(), E)

    if dedup:
        utok, chosen = _ref_choose_copies(tok, cdisk, ndisks, policy)
    else:
        chosen = np.argsort(tok, kind="stable")
        utok = tok[chosen]
    d = cdisk[chosen]
    o = coff[chosen]
    n = chosen.shape[0]

    # coalesce per disk, in offset order
    key = (d.astype(np.uint64) << np.uint64(52)) | o
    srt = np.argsort(key)   # equal keys are the same copy: order among them is moot
    ds, os_ = d[srt], o[srt]
    newrun = np.empty(n, dtype=bool)
    newrun[0] = True
    gap_ok = os_[1:] <= os_[:-1] + np.uint64(E + max_gap)
    np.logical_or(ds[1:] != ds[:-1], ~gap_ok, out=newrun[1:])
    run = np.cumsum(newrun) - 1
    rs = np.flatnonzero(newrun)
    re = np.append(rs[1:], n) - 1
    if max_request > 0 and (os_[re] - os_[rs]).max() + np.uint64(E) > np.uint64(max_request):
        # split runs longer than max_request (only runs that need it pay)
        run_base = os_[rs][run]
        chunk = (os_ - run_base) // np.uint64(max(max_request, E))
        split = np.empty(n, dtype=bool)
        split[0] = False
        split[1:] = (chunk[1:] != chunk[:-1]) & ~newrun[1:]
        newrun |= split
        run = np.cumsum(newrun) - 1
        rs = np.flatnonzero(newrun)
        re = np.append(rs[1:], n) - 1
    bs = np.uint64(block_size)
    rstart = os_[rs] // bs * bs
    rend = (os_[re] + np.uint64(E) + bs - np.uint64(1)) // bs * bs
    rdisk = ds[rs]
    # merge runs whose aligned ranges now overlap or touch across a shared block
    if rs.shape[0] > 1:
        newreq = np.empty(rs.shape[0], dtype=bool)
        newreq[0] = True
        np.logical_or(rdisk[1:] != rdisk[:-1], rstart[1:] >= rend[:-1], out=newreq[1:])
        if not newreq.all():
            grp = np.cumsum(newreq) - 1
            qs = np.flatnonzero(newreq)
            qe = np.append(qs[1:], rs.shape[0]) - 1
            rstart, rend, rdisk = rstart[qs], rend[qe], rdisk[qs]
            run = grp[run]
    nreq = rstart.shape[0]
    length = rend - rstart

    # round-robin submission order: rank within disk, then disk
    per_disk = np.bincount(rdisk, minlength=ndisks)
    rank = np.arange(nreq) - np.repeat(np.cumsum(per_disk) - per_disk, per_disk)
    sub = np.argsort(rank * ndisks + rdisk)
    pos = np.empty(nreq, dtype=np.int64)
    pos[sub] = np.arange(nreq)
    lens_sub = length[sub]
    dst_sub = np.zeros(nreq, dtype=np.uint64)
    if nreq > 1:
        np.cumsum(lens_sub[:-1], out=dst_sub[1:])
    dst = dst_sub[pos]                       # per request, in sorted order
    src_sorted = dst[run] + (os_ - rstart[run])
    src = np.empty(n, dtype=np.uint64)
    src[srt] = src_sorted

    disk_entries = np.bincount(d, minlength=ndisks).astype(np.int64)
    disk_bytes = np.bincount(rdisk, weights=length.astype(np.float64),
                             minlength=ndisks).astype(np.int64)
    return Plan(disk=rdisk[sub].astype(np.int32), offset=rstart[sub],
                length=lens_sub.astype(np.uint32), dst=dst_sub,
                staging_bytes=int(lens_sub.sum()), tokens=utok, src=src,
                copy=chosen, disk_entries=disk_entries, disk_bytes=disk_bytes,
                entry_bytes=E)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 400), st.integers(1, 8), st.integers(0, 2**31), st.booleans(),
       st.sampled_from(["balanced", "first"]), st.sampled_from([0, 64, 5000]),
       st.sampled_from([4096, 8192, 1 << 19]), st.sampled_from([64, 100, 4096]))
def test_native_planner_equals_the_numpy_specification(n, ndisks, seed, dedup, policy,
                                                       max_gap, max_request, E):
    rng = np.random.default_rng(seed)
    S = int(rng.integers(n, 3 * n + 1))
    tok = rng.integers(0, S, n)
    cdisk = rng.integers(0, ndisks, n).astype(np.int32)
    slot = rng.integers(0, 4 * n, n).astype(np.uint64)
    coff = slot * np.uint64(E) + np.uint64(4096)
    kw = dict(ndisks=ndisks, entry_bytes=E, block_size=512, max_gap=max_gap,
              max_request=max_request, policy=policy, dedup=dedup)
    got = plan_reads(tok, cdisk, coff, **kw)
    want = reference_plan(tok, cdisk, coff, **kw)
    for f in ("disk", "offset", "length", "dst", "tokens", "src", "copy", "disk_entries",
              "disk_bytes"):
        a, b = getattr(got, f), getattr(want, f)
        assert a.tolist() == b.tolist(), f
    assert got.staging_bytes == want.staging_bytes


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 12), st.integers(0, 2**31), st.booleans(),
       st.sampled_from(["balanced", "first"]), st.sampled_from([0, 1, 4096]),
       st.sampled_from([1, 4096, 12288, 1 << 19]), st.sampled_from([1, 64, 4096]),
       st.sampled_from(["dense", "huge", "odd", "same"]), st.sampled_from([512, 4096]),
       st.sampled_from([np.int32, np.int64, np.uint16]))
def test_native_planner_equals_the_specification_at_the_key_edges(
        n, ndisks, seed, dedup, policy, max_gap, max_request, E, offs, bs, disk_dtype):
    """The planner's compressed sort keys (token bits only; offsets relative to
    the smallest, without common trailing zeros, under the disk bits, 32 bits
    when they fit and 64-bit records else), its chunk split without division,
    and its argument checks in C: equal to the numpy specification on tokens
    up to 2**31 - 1, offsets up to 2**52 - 1, odd offsets, every copy on one
    offset, many copies per token, any input dtype."""
    rng = np.random.default_rng(seed)
    S = int(rng.integers(1, 2 * n + 1)) if rng.random() < 0.5 else 2**31
    tok = np.minimum(rng.integers(0, S, n), 2**31 - 1)
    if rng.random() < 0.3:
        tok[rng.integers(0, n)] = 2**31 - 1
    cdisk = rng.integers(0, ndisks, n).astype(disk_dtype)
    slot = rng.integers(0, 4 * n, n).astype(np.uint64)
    coff = {"dense": slot * np.uint64(E) + np.uint64(4096),
            "huge": np.uint64(2**52 - 1) - slot * np.uint64(E),
            "odd": slot * np.uint64(E) + np.uint64(rng.integers(0, 7)),
            "same": np.full(n, 3 * 4096, np.uint64)}[offs]
    kw = dict(ndisks=ndisks, entry_bytes=E, block_size=bs, max_gap=max_gap,
              max_request=max_request, policy=policy, dedup=dedup)
    got = plan_reads(tok, cdisk, coff, **kw)
    want = reference_plan(tok.astype(np.int64), cdisk.astype(np.int32), coff, **kw)
    for f in ("disk", "offset", "length", "dst", "tokens", "src", "copy", "disk_entries",
              "disk_bytes"):
        assert getattr(got, f).tolist() == getattr(want, f).tolist(), f
    assert got.staging_bytes == want.staging_bytes
    # out-of-range arguments are refused by the C checks, whatever the dtype
    from swarmfs._errors import InvalidArgumentError
    i = int(rng.integers(0, n))
    for bad in ("tok", "disk", "off"):
        t, d, o = tok.copy(), cdisk.astype(np.int64), coff.copy()
        if bad == "tok":
            t[i] = 2**31
        elif bad == "disk":
            d[i] = ndisks
        else:
            o[i] = np.uint64(2**52)
        for dd in (d, d.astype(np.int32)):
            with pytest.raises(InvalidArgumentError):
                plan_reads(t, dd, o, **kw)


@pytest.mark.parametrize("kw", [dict(max_gap=2**64), dict(entry_bytes=2**32),
                                dict(block_size=2**64), dict(max_request=2**34),
                                dict(entry_bytes=2**31, max_request=2**30 + 1),
                                dict(dedup="no"), dict(dedup=1)])
def test_arguments_that_would_overflow_a_request_are_refused(kw):
    """A request's length is 32-bit: sizes that could reach 4 GiB, and numbers
    C cannot take, are InvalidArgumentError (not OverflowError or a length cut
    to 0)."""
    from swarmfs._errors import InvalidArgumentError
    args = dict(ndisks=1, entry_bytes=64, block_size=512)
    args.update(kw)
    with pytest.raises(InvalidArgumentError):
        plan_reads([0, 1], [0, 0], [0, 64], **args)


def _planner_ways(tok, cdisk, coff, *, E, bs, dedup, max_gap=0):
    """The ways se_plan_reads takes (native/planner.c plan_body's conditions,
    mirrored): (token bitmap, key bitmap, coalescing without merges, a run
    at a time).  A key bitmap falls back to the radix sort when two chosen
    entries share a key."""
    tok, cdisk, coff = (np.asarray(a).astype(np.int64) for a in (tok, cdisk, coff))
    m = tok.shape[0]
    token_bitmap = dedup and (int(tok.max()) >> 6) + 1 <= m
    omin, omax, o0 = int(coff.min()), int(coff.max()), int(coff[0])
    ozor = int(np.bitwise_or.reduce(coff ^ o0))
    tz = (ozor & -ozor).bit_length() - 1 if ozor else 0
    ob, dmax = ((omax - omin) >> tz).bit_length(), int(cdisk.max())
    key_bitmap = (ob + dmax.bit_length() <= 32
                  and ((dmax << ob) | ((omax - omin) >> tz)) < 16 * m + 65536)
    simple = not ((omin | ozor | E) & (bs - 1)) and (not ozor or 1 << tz >= E)
    return token_bitmap, key_bitmap, simple, key_bitmap and simple and (E + max_gap) >> tz <= 1


def _case(name, rng):
    """Inputs (tok, cdisk, coff, ndisks, E, bs, max_gap, max_request, dedup)
    and the ways they take (as _planner_ways; a collision: the key radix
    fallback)."""
    E, bs, gap, maxr, dedup, nd = 4096, 4096, 0, MAX_REQUEST, True, 5
    n = int(rng.integers(300, 700))
    S = 4 * n
    base = rng.choice(S, n, replace=False)
    reps = rng.integers(1, 4, n) if name != "two_copies" else np.where(rng.random(n) < 0.3, 2, 1)
    tok = np.repeat(base, reps)
    m = tok.shape[0]
    # copies striped over the disks, each copy at its own place (as the store does)
    slot = rng.permutation(m)
    cdisk, coff = slot % nd, (slot // nd).astype(np.uint64) * np.uint64(E) + np.uint64(8192)
    ways = (True, True, True, True)
    if name == "unaligned":        # 100-byte entries 200 bytes apart: each its own
        E, bs = 100, 512           # run, merged where they share a block
        coff = (slot // nd).astype(np.uint64) * np.uint64(200) + np.uint64(7)
        ways = (True, True, False, False)
    elif name == "overlapping":    # entries longer than their spacing, short chunks
        E, maxr = 12288, 8192
        ways = (True, True, False, False)
    elif name == "collision":      # two tokens' only copies at one place
        tok, cdisk, coff = tok[reps.cumsum() - 1], cdisk[reps.cumsum() - 1], coff[reps.cumsum() - 1]
        cdisk[1], coff[1] = cdisk[0], coff[0]
    elif name == "sparse_tokens":  # token ids far above 64 per candidate: the token sort
        tok = tok * 4099 % (2**31 - 1)
        ways = (False, True, True, True)
    elif name == "wide_offsets":   # offsets spread over 2**51: the key radix sort
        coff = coff + (slot % 2).astype(np.uint64) * np.uint64(2**51)
        ways = (True, False, True, False)
    elif name == "no_dedup":
        dedup = False
        ways = (False, True, True, True)
    elif name == "single_copies":  # no multi-copy token
        tok = np.unique(tok)
        m = tok.shape[0]
        cdisk, coff = cdisk[:m], coff[:m]
    elif name == "one_token":      # every candidate a copy of one token
        tok = np.full(m, 5)
    elif name == "tiny":           # fewer candidates than one AVX-512 step
        tok, cdisk, coff = tok[:11], cdisk[:11], coff[:11]
        ways = _planner_ways(tok, cdisk, coff, E=E, bs=bs, dedup=dedup)
    elif name == "long_runs":      # runs longer than max_request: split
        maxr = 3 * E + 100
    elif name == "gap":            # runs across free slots: one entry at a time
        gap = 2 * E
        ways = (True, True, True, False)
    elif name == "apart":          # entries shorter than their spacing: runs of one
        E, bs = 512, 512
    elif name in ("disks_abut", "small_disks"):
        # one copy per token, every slot taken, a power of two per disk: the
        # last key of a disk is next to the first of the next (64 or 8 keys
        # a disk: whole words, or several disks in a word)
        per = 64 if name == "disks_abut" else 8
        m = per * nd
        tok, slot = rng.permutation(m), rng.permutation(m)
        cdisk, coff = slot % nd, (slot // nd).astype(np.uint64) * np.uint64(E)
        if name == "small_disks":
            maxr = 3 * E + 100     # and each run split in two
    return tok, cdisk.astype(np.int32), coff, nd, E, bs, gap, maxr, dedup, ways


@pytest.mark.parametrize("name", ["two_copies", "mixed_copies", "unaligned", "overlapping",
                                  "collision", "sparse_tokens", "wide_offsets", "no_dedup",
                                  "single_copies", "one_token", "tiny", "long_runs", "gap",
                                  "apart", "disks_abut", "small_disks"])
@pytest.mark.parametrize("policy", ["balanced", "first"])
def test_each_way_through_the_native_planner_equals_the_specification(name, policy, each_path):
    """The token bitmap (dedup without a token sort) and its fallback, the
    key bitmap (order without a (disk, offset) sort) and its fallbacks (keys
    too wide, two entries at one key), coalescing with and without merges,
    a run at a time (runs split at max_request, runs of one, disks whose keys
    abut, within a word or across words) or an entry at a time, multi-copy
    tokens of equal and of mixed copy counts, on every kernel path (the range
    pass has an AVX-512 form): equal to the numpy specification."""
    from swarmfs.store._kernels import set_kernel_path
    for seed in range(3):
        tok, cdisk, coff, nd, E, bs, gap, maxr, dedup, ways = _case(name,
                                                                   np.random.default_rng(seed))
        assert _planner_ways(tok, cdisk, coff, E=E, bs=bs, dedup=dedup, max_gap=gap) == ways
        kw = dict(ndisks=nd, entry_bytes=E, block_size=bs, max_gap=gap, max_request=maxr,
                  policy=policy, dedup=dedup)
        want = reference_plan(tok, cdisk, coff, **kw)
        if name == "unaligned":
            assert want.num_requests < want.num_entries * 0.7   # merged
        if name in ("long_runs", "disks_abut", "small_disks"):
            assert (want.length > E).any() and (want.length <= maxr + E).all()
        if name in ("long_runs", "small_disks"):      # runs split after 4 entries
            assert (want.length == 4 * E).any()
        for path in each_path:
            set_kernel_path(path)
            got = plan_reads(tok, cdisk, coff, **kw)
            for f in ("disk", "offset", "length", "dst", "tokens", "src", "copy",
                      "disk_entries", "disk_bytes"):
                assert getattr(got, f).tolist() == getattr(want, f).tolist(), (path, f)
            assert got.staging_bytes == want.staging_bytes


def test_a_request_that_would_reach_4_gib_is_refused():
    """Six 1 GiB entries one byte off block alignment: split at max_request,
    then merged again where their blocks overlap, the one request was 6 GiB
    and its uint32 length wrapped to 2 GiB (staging_bytes said 6 GiB)."""
    from swarmfs._errors import InvalidArgumentError
    n, E = 6, 2**30
    off = np.arange(n, dtype=np.uint64) * np.uint64(E) + np.uint64(1)
    with pytest.raises(InvalidArgumentError, match="4 GiB"):
        plan_reads(np.arange(n), [0] * n, off, ndisks=1, entry_bytes=E, block_size=512,
                   max_request=2**30)
    ok = plan_reads(np.arange(n), [0] * n, off - np.uint64(1), ndisks=1, entry_bytes=E,
                    block_size=512, max_request=2**30)          # aligned: six 1 GiB requests
    assert ok.length.tolist() == [E] * n and ok.staging_bytes == n * E
