"""The scheduler (inference/scheduler.py) is a pure function of the waiting queue and the running set: who is
dropped, who is admitted, and which running requests' rows share which forward, tested without a model."""

from __future__ import annotations

import random

from dllm.inference.scheduler import Limits, Running, Waiting, admit, plan


def test_admission_in_arrival_order_while_rows_fit():
    waiting = [Waiting(1, 3), Waiting(2, 4), Waiting(3, 1)]
    got = admit(waiting, [Running(0, 2, kind="causal")], Limits(max_rows=8))
    assert got.admit == (1,) and got.drop == ()  # 2 + 3 fit; 4 more would not, and 3 may not overtake 2


def test_an_empty_engine_takes_any_one_request():
    got = admit([Waiting(1, 100), Waiting(2, 1)], [], Limits(max_rows=8))
    assert got.admit == (1,)  # nothing waits forever: it runs alone
    assert admit([Waiting(2, 1)], [Running(1, 100, kind="causal")], Limits(max_rows=8)).admit == ()


def test_the_cancelled_are_dropped_and_free_their_rows():
    waiting = [Waiting(3, 2, cancelled=True), Waiting(4, 6)]
    running = [Running(1, 4, cancelled=True, kind="causal"), Running(2, 2, kind="canvas", length=10)]
    got = admit(waiting, running, Limits(max_rows=8))
    assert set(got.drop) == {1, 3} and got.admit == (4,)  # the running one's 4 rows are free again


def test_max_requests_caps_the_running_set():
    waiting = [Waiting(2, 1), Waiting(3, 1)]
    assert admit(waiting, [Running(1, 1, kind="own")], Limits(max_rows=8, max_requests=1)).admit == ()
    assert admit(waiting, [], Limits(max_rows=8, max_requests=1)).admit == (2,)
    assert admit(waiting, [], Limits(max_rows=8, max_requests=2)).admit == (2, 3)


def test_every_causal_request_shares_one_forward():
    running = [Running(i, 1 + i % 3, kind="causal") for i in range(6)] + [Running(9, 1, kind="own")]
    forwards = plan(running, Limits())
    assert [(f.kind, f.ids) for f in forwards] == [("causal", (0, 1, 2, 3, 4, 5)), ("own", (9,))]


def test_canvases_share_a_forward_per_mask_and_length_bucket():
    running = [
        Running(1, 1, kind="canvas", mask=None, length=10),
        Running(2, 2, kind="canvas", mask=None, length=11),
        Running(3, 1, kind="canvas", mask=None, length=33),  # more than twice 11: a bucket of its own
        Running(4, 1, kind="canvas", mask=4, length=12),
        Running(5, 1, kind="canvas", mask=2, length=12),  # another block size: another mask
        Running(6, 1, kind="canvas_cached", mask=4),
        Running(7, 1, kind="canvas_cached", mask=4),
        Running(8, 1, kind="canvas_cached", mask=2),
    ]
    forwards = {(f.kind, f.mask, f.ids) for f in plan(running, Limits())}
    assert forwards == {("canvas", None, (3,)), ("canvas", None, (2, 1)), ("canvas", 4, (4,)), ("canvas", 2, (5,)),
                        ("canvas_cached", 4, (6, 7)), ("canvas_cached", 2, (8,))}  # fmt: skip


def test_without_sharing_each_request_runs_its_own_forward():
    running = [Running(1, 1, kind="causal"), Running(2, 1, kind="causal"), Running(3, 2, kind="canvas", length=5)]
    assert [f.ids for f in plan(running, Limits(share_forwards=False))] == [(1,), (2,), (3,)]


def test_every_running_request_is_in_exactly_one_forward():
    rng = random.Random(0)
    kinds = ["causal", "canvas", "canvas_cached", "own"]
    for _ in range(200):
        running = [Running(i, rng.randint(1, 4), rng.random() < 0.1, rng.choice(kinds), rng.choice([None, 2, 4]),
                           rng.randint(1, 64)) for i in range(rng.randint(0, 12))]  # fmt: skip
        ids = [i for f in plan(running, Limits()) for i in f.ids]
        assert sorted(ids) == sorted(r.id for r in running if not r.cancelled)
        for f in plan(running, Limits()):  # a forward holds requests of one kind and mask only
            members = [r for r in running if r.id in f.ids]
            assert {r.kind for r in members} == {f.kind}
            if f.kind in ("canvas", "canvas_cached"):
                assert {r.mask for r in members} == {f.mask}
                if f.kind == "canvas":
                    assert 2 * min(r.length for r in members) > max(r.length for r in members)
