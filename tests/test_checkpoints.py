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


def test_a_resume_that_cannot_make_progress_on_the_cluster_is_refused_with_a_setting_that_fits():
    """On resume Ray Data adds its CheckpointFilter actor (1 CPU): where the pass's model actors (as many as fit)
    and that actor leave no room for a read or write task (0.25 CPU), the pass would wait forever. By hand:
    a 1-CPU actor on one 2-CPU node leaves 1, the filter 0: refused, and 0.75 is the most that leaves 0.25. (The
    refusal on a real cluster, through `wbrag embed`: tests/cluster/test_fault_tolerance.py.)"""
    from wbrag_ray.checkpoints import resume_places, resume_refusal
    from wbrag_ray.stages.base import Resources

    laptop = [{"CPU": 2.0}]
    refused = resume_refusal(Resources(num_cpus=1.0), "embedder", "embed", laptop)
    assert "beside the pass's 1 actor(s) x 1 CPU, and the cluster's CPUs (2) have no room" in refused
    assert "--set embedder.num_cpus=0.75 fits" in refused
    assert resume_places(Resources(num_cpus=0.75), laptop) and resume_places(Resources(num_cpus=0.5), laptop)
    # a pool of which one actor fits runs on it: 2 x 1.5 CPUs on a 1-CPU head and a 2-CPU worker (a worker
    # node lost) places one actor on the worker (0.5 left, the read task's), the filter on the head
    assert resume_places(Resources(num_cpus=1.5, concurrency=2), [{"CPU": 1.0}, {"CPU": 2.0}])
    # two 1.5-CPU actors on two 2-CPU nodes leave 0.5 + 0.5, no room for the filter; placed first, it leaves room
    # for one actor and the task: not refused (Ray starts them together, in no fixed order)
    assert resume_places(Resources(num_cpus=1.5, concurrency=2), [{"CPU": 2.0}, {"CPU": 2.0}])
    # one 2.25-CPU node: the filter first leaves 1.25, no room for an actor; an actor first leaves 0.75, none for
    # the filter
    assert not resume_places(Resources(num_cpus=1.5, concurrency=2), [{"CPU": 2.25}])
    # plain tasks (the embedding pruner's, 1 CPU): the filter and one task
    assert resume_places(Resources(num_cpus=1.0, actors=False), laptop)
    refused = resume_refusal(Resources(num_cpus=1.0, actors=False), None, "predict", [{"CPU": 1.0}])
    assert "num_cpus" not in refused.split("Fix:")[1] and "more CPUs" in refused  # no setting to lower
