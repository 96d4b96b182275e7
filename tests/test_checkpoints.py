"""The stage checkpoint's mechanics without Ray (wbrag_ray.checkpoints): committed answer blocks read back
exactly, a half-written block never read, a checkpoint of other settings never resumed, and the folder gone
once the stage is complete. The kill-and-resume tests are tests/pipelines/test_resume.py and
tests/cluster/test_fault_tolerance.py."""

import numpy as np

from wbrag_ray.checkpoints import AnswerStore, active, stage_checkpoint
from wbrag_ray.run import RunFolder
from wbrag_ray.storage import resolve


def test_committed_answers_read_back_exactly_and_a_half_written_block_is_never_read(tmp_path):
    folder = resolve(str(tmp_path / "answers"))
    store = AnswerStore(folder, block_rows=2, block_seconds=3600)
    probs = np.array([0.1234567, 1 / 3], dtype=np.float32)  # as a scored answer comes back through Arrow
    store.add([(b"k" * 16, ("an answer", ["an", " answer"], probs, True))])
    assert AnswerStore(folder).answers == {}  # one row pending: not committed yet
    store.add([(b"j" * 16, ("other", [], [], False))])  # the block is full: committed
    (tmp_path / "answers" / "block-x.parquet.tmp").write_bytes(b"PAR1 half a file")  # a write cut short
    again = AnswerStore(folder)
    assert again.loaded == 2
    text, tokens, got_probs, finished = again.answers[b"k" * 16]
    assert (text, tokens, finished) == ("an answer", ["an", " answer"], True)
    assert got_probs == probs.tolist()  # float32 values to the last bit
    assert again.answers[b"j" * 16] == ("other", [], [], False)


def test_a_checkpoint_made_under_other_settings_is_removed_before_the_stage_starts(tmp_path, capsys):
    folder = resolve(str(tmp_path / "ckpt"))
    with stage_checkpoint(folder, {"config": {"model": "a"}}, "eval-x") as checkpoint:
        assert active() is checkpoint
        checkpoint.answers(block_rows=1).add([(b"k" * 16, ("yes",))])
    assert active() is None
    with stage_checkpoint(folder, {"config": {"model": "a"}}, "eval-x") as checkpoint:
        assert checkpoint.answers().loaded == 1  # same settings: resumed
    with stage_checkpoint(folder, {"config": {"model": "b"}}, "eval-x") as checkpoint:
        assert checkpoint.answers().loaded == 0  # other settings: started over
    assert "made with other settings: starting over" in capsys.readouterr().out


def test_a_complete_stage_records_what_it_resumed_and_leaves_no_checkpoint(tmp_path):
    run = RunFolder(str(tmp_path / "run"))

    def work():
        checkpoint = active()
        checkpoint.count(resumed=3, computed=5)
        checkpoint.answers(block_rows=1).add([(b"k" * 16, ("yes",))])
        assert run.layout.checkpoint("stage-a").exists()
        return {"rows_out": 8}

    stats = run.run_stage("stage-a", work, fingerprint={"config": {}})
    assert (stats["rows_resumed"], stats["rows_computed"]) == (3, 5)
    assert run.stats("stage-a")["rows_resumed"] == 3
    assert not run.layout.checkpoint("stage-a").exists()


def test_a_resume_that_cannot_make_progress_on_the_cluster_is_refused_with_a_setting_that_fits(capsys):
    """On resume Ray Data adds its CheckpointFilter actor (1 CPU): a pass whose model actors leave less than 1 CPU
    and a light task's 0.25 on the cluster would wait forever. The numbers by hand: 2 actors x 1.5 CPU + 1 +
    0.25 = 4.25 CPUs; on 4 CPUs each actor may ask for (4 - 1.25) / 2 = 1.375, so 1.25 in quarters."""
    import pytest

    from wbrag_ray.checkpoints import check_resume_fits, resume_cpus
    from wbrag_ray.config import ConfigError
    from wbrag_ray.stages.base import Resources

    pool = Resources(num_cpus=1.5, concurrency=2)
    assert resume_cpus(pool) == 4.25
    assert resume_cpus(Resources(num_cpus=1.0, actors=False)) == 2.0  # plain tasks: the filter and one task
    check_resume_fits(pool, "embedder", "embed", cluster_cpus=4.25, nodes=1)  # exactly enough: runs
    with pytest.raises(ConfigError) as refused:
        check_resume_fits(pool, "embedder", "embed", cluster_cpus=4, nodes=1)
    assert "needs 4.25 CPUs at once (2 actor(s) x 1.5 CPU" in str(refused.value)
    assert "--set embedder.num_cpus=1.25 fits" in str(refused.value)
    with pytest.raises(ConfigError) as refused:  # no setting to lower, and none would fit: only more CPUs
        check_resume_fits(Resources(num_cpus=1.0, actors=False), None, "predict", cluster_cpus=1, nodes=1)
    assert "num_cpus" not in str(refused.value).split("Fix:")[1] and "more CPUs" in str(refused.value)
    # several nodes: an autoscaler may add CPUs, so a warning, not a refusal
    check_resume_fits(pool, "embedder", "embed", cluster_cpus=4, nodes=3)
    assert "warning: [embed] resuming from the checkpoint needs 4.25 CPUs" in capsys.readouterr().out
