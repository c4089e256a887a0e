"""Bucket-size tuning: settings and the tuner's schedule (pure, one process)."""

from __future__ import annotations

import pytest
from plait.collectives.tuning import Tuning

from plait.errors import ConfigError
from plait.parallel.autotune import CANDIDATES_MB, BucketTuner, bucket_setting, candidates


def test_a_given_size_is_fixed_and_none_tunes():
    assert bucket_setting(8, 25.0, {}) == (8.0, False)
    assert bucket_setting(0, 25.0, {}) == (0.0, False)
    assert bucket_setting(None, 25.0, {}) == (CANDIDATES_MB[0], True)
    assert bucket_setting(None, 25.0, {"PLAIT_BUCKET_MB": "2.5"}) == (2.5, False)
    assert bucket_setting(None, 25.0, {"PLAIT_AUTOTUNE": "0"}) == (25.0, False)
    assert bucket_setting(None, 25.0, {"PLAIT_AUTOTUNE_MB": "3,5"}) == (3.0, True)
    assert candidates({"PLAIT_AUTOTUNE_MB": "0, 0.5,2"}) == [0.0, 0.5, 2.0]


def test_horovod_settings_are_honoured_where_plait_has_none():
    """Horovod's knobs (what horovodrun's tuning flags set) mean what they mean in Horovod;
    plait's own settings win."""
    mib = str(2**20)
    assert bucket_setting(None, 25.0, {"HOROVOD_FUSION_THRESHOLD": mib}) == (1.0, False)
    assert bucket_setting(None, 25.0, {"HOROVOD_FUSION_THRESHOLD": "0"}) == (0.0, False)
    assert bucket_setting(None, 25.0, {"HOROVOD_FUSION_THRESHOLD": mib,
                                       "HOROVOD_AUTOTUNE": "1"}) == (CANDIDATES_MB[0], True)
    assert bucket_setting(None, 25.0, {"HOROVOD_FUSION_THRESHOLD": mib,
                                       "PLAIT_BUCKET_MB": "3"}) == (3.0, False)
    assert bucket_setting(2, 25.0, {"HOROVOD_FUSION_THRESHOLD": mib}) == (2.0, False)
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD='64MB'"):
        bucket_setting(None, 25.0, {"HOROVOD_FUSION_THRESHOLD": "64MB"})
    hier = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    assert Tuning.from_env(hier).allreduce == "hierarchical"
    assert Tuning.from_env({**hier, "PLAIT_ALLREDUCE": "ring"}).allreduce == "ring"
    assert Tuning.from_env({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}).allreduce == "auto"


@pytest.mark.parametrize("arg, env, name", [
    (-1, {}, "bucket_mb"), ("4", {}, "bucket_mb"), (True, {}, "bucket_mb"),
    (None, {"PLAIT_BUCKET_MB": "big"}, "PLAIT_BUCKET_MB"),
    (None, {"PLAIT_BUCKET_MB": "-2"}, "PLAIT_BUCKET_MB"),
    (None, {"PLAIT_AUTOTUNE": "maybe"}, "PLAIT_AUTOTUNE"),
    (None, {"PLAIT_AUTOTUNE_STEPS": "0"}, "PLAIT_AUTOTUNE_STEPS"),
    (None, {"PLAIT_AUTOTUNE_MB": "1,x"}, "PLAIT_AUTOTUNE_MB"),
    (None, {"PLAIT_AUTOTUNE_MB": "1,-4"}, "PLAIT_AUTOTUNE_MB"),
])
def test_bad_settings_name_the_setting(arg, env, name):
    with pytest.raises(ConfigError, match=name):
        bucket_setting(arg, 25.0, env)


def test_tuner_skips_then_times_each_candidate_and_picks_the_fastest():
    tuner = BucketTuner([1, 4, 16], steps=2, skip=1)
    seen = []
    times = {1: 0.3, 4: 0.1, 16: 0.2}
    while not tuner.measured:
        seen.append(tuner.current)
        tuner.observe(times[int(tuner.current)])
    assert seen == [1, 1, 1, 4, 4, 4, 16, 16, 16]  # one skipped + two timed each
    assert tuner.medians() == [0.3, 0.1, 0.2]
    assert tuner.decide([0.3, 0.1, 0.2]) == 4 and tuner.current == 4 and not tuner.tuning


def test_dropped_candidates_are_never_chosen_and_ties_take_the_first():
    tuner = BucketTuner([1, 4, 16], steps=1, skip=0)
    tuner.observe(0.2)
    tuner.drop_current()  # 4 gives the same buckets as 1
    tuner.observe(0.2)
    assert tuner.measured and tuner.medians() == [0.2, float("inf"), 0.2]
    assert tuner.decide(tuner.medians()) == 1


def test_the_progress_thread_drives_open_mpis_requests_only_with_a_core_to_spare():
    """Rings always have the thread; Open MPI's own requests only across hosts, with two
    cores per rank, or with PLAIT_PROGRESS=always; a bad value names the variable."""
    auto = Tuning.from_env({})
    assert not auto.drives_requests(hosts=1, cores_per_rank=1.0)
    assert auto.drives_requests(hosts=1, cores_per_rank=2.0)
    assert auto.drives_requests(hosts=2, cores_per_rank=0.5)
    assert Tuning.from_env({"PLAIT_PROGRESS": "always"}).drives_requests(1, 0.5)
    assert "progress=auto" in auto.describe()
    with pytest.raises(ConfigError, match="PLAIT_PROGRESS='never'"):
        Tuning.from_env({"PLAIT_PROGRESS": "never"})
