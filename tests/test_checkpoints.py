"""The stage checkpoint's mechanics without Ray (wbrag_ray.checkpoints): committed answer blocks read back
exactly, a half-written block never read, a checkpoint of other settings never resumed, and the folder gone
once the stage is complete. The kill-and-resume tests are tests/pipelines/test_resume.py and
tests/cluster/test_fault_tolerance.py."""

import numpy as np

from wbrag_ray.checkpoints import AnswerStore, active, stage_checkpoint
from wbrag_ray.config import WbragConfig
from wbrag_ray.run import RunFolder, RunStage
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

    stats = run.execute(RunStage("stage-a"), WbragConfig(), work)
    assert (stats["rows_resumed"], stats["rows_computed"]) == (3, 5)
    assert run.stats("stage-a")["rows_resumed"] == 3
    assert not run.layout.checkpoint("stage-a").exists()


def test_a_resume_runs_where_the_run_ran_its_actors_narrowed_to_fit_beside_the_checkpoint_filter():
    """On resume Ray Data adds its CheckpointFilter actor (1 CPU): where the pass's model actors (as many as fit)
    and that actor leave no room for a read or write task (0.25 CPU), the pass would wait forever. By hand:
    a 1-CPU actor on one 2-CPU node leaves 1, the filter 0, and 0.75 is the most that leaves 0.25: the resume runs
    at 0.75 (placement only). Refused only where no placement fits. (On a real cluster, through `wbrag embed`:
    tests/cluster/test_fault_tolerance.py, and tests/test_storage.py's full disk.)"""
    from wbrag_ray.checkpoints import resume_fit, resume_places, resume_refusal
    from wbrag_ray.stages.base import Resources

    laptop = [{"CPU": 2.0}]
    assert not resume_places(Resources(num_cpus=1.0), laptop)
    assert resume_fit(Resources(num_cpus=1.0), laptop) == Resources(num_cpus=0.75)
    assert resume_refusal(Resources(num_cpus=1.0), "embed", laptop) is None
    assert resume_fit(Resources(num_cpus=0.5), laptop) == Resources(num_cpus=0.5)  # fits as it is: unchanged
    # two 1-CPU actors: 0.75 CPU each, of which one starts beside the filter (a pool runs on the actors that fit)
    assert resume_fit(Resources(num_cpus=1.0, concurrency=2), laptop) == Resources(num_cpus=0.75, concurrency=2)
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
    assert resume_fit(Resources(num_cpus=1.0, actors=False), [{"CPU": 1.0}]) is None  # the filter alone fills it
    refused = resume_refusal(Resources(num_cpus=1.0, actors=False), "predict", [{"CPU": 1.0}])
    assert "the cluster's CPUs (1) have no room" in refused and "more CPUs" in refused


def test_a_pass_slower_than_its_row_block_commits_by_time_and_a_kill_resumes_those_rows(demo_run_copy, ray_cluster,
                                                                                       tmp_path):
    """`generator.checkpoint_seconds`: an evaluation's answer pass of one prompt a batch, whose rows never fill a
    block of `checkpoint_rows` (1,024), commits what it answered each second instead; the driver SIGKILLed once
    some answers are committed, the same command resumes those rows and answers every question once."""
    import sys

    from tests.conftest import demo_questions, joining_env, write_jsonl
    from tests.drivers import kill_once_committed
    from wbrag_ray.checkpoints import progress
    from wbrag_ray.cli import main
    from wbrag_ray.evaluation.stage import EVAL

    run, _ = demo_run_copy
    questions = [{**q, "question": f"{q['question']} (answered by time)"} for q in demo_questions()]
    qa = write_jsonl(tmp_path / "qa.jsonl", questions)
    args = ["eval", str(run), "--dataset", str(qa), "--name", "bytime", "--methods", "naive",
            "--set", "generator.batch_size=1", "--set", "generator.checkpoint_seconds=1",
            "--set", "generator.max_new_tokens=24"]
    folder = RunFolder(str(run))
    checkpoint = folder.layout.checkpoint(EVAL.instance({"label": "bytime"}))
    committed, log = kill_once_committed([sys.executable, "-m", "wbrag_ray.cli", *args], joining_env(ray_cluster),
                                         checkpoint, 1, ray_cluster)
    assert 0 < committed < len(questions), (committed, log[-3000:])
    assert progress(checkpoint)["committed"] == committed  # in blocks far below checkpoint_rows
    assert not folder.is_complete(EVAL.instance({"label": "bytime"}))
    assert main(args) == 0
    stats = folder.stats(EVAL.instance({"label": "bytime"}))
    assert stats["rows_resumed"] == committed and stats["rows_computed"] == len(questions) - committed, stats
    predictions = folder.layout.eval_result("bytime", "naive").predictions.read_table(["id"])["id"].to_pylist()
    assert sorted(predictions) == sorted(q["id"] for q in questions)
