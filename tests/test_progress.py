"""One progress line per pass: Ray Data's non-interactive multi-line dump becomes the running pass's line,
lines come at most every interval and once at the end, and `-v` gives Ray's own output back."""

import logging

from wbrag_ray import progress

RAY_DUMP = ["======= Running Dataset: dataset_3_0 =======", "Total Progress: 120/400",
            "Active & requested resources: 1/2 CPU, 12.0MiB/1.0GiB object store", "",
            "- MapBatches(_forward): 120/400", "  Tasks: 1; Actors: 0; Queued blocks: 0;", "=" * 44]


def _ray_logger_emits(lines):
    logger = logging.getLogger(progress.RAY_PROGRESS_LOGGER)
    for line in lines:
        logger.info(line)


def test_ray_data_dump_becomes_one_line_of_the_running_pass(caplog):
    logger = logging.getLogger(progress.RAY_PROGRESS_LOGGER)
    logger.addFilter(progress.RayProgressFilter())
    try:
        with caplog.at_level(logging.INFO):
            with progress.running("self-rag:judge-retrieval") as p:
                p.interval_s = 0.0
                _ray_logger_emits(RAY_DUMP)
                assert p.done == 120 and p.total == 400
            _ray_logger_emits(RAY_DUMP)  # outside a pass: dropped all the same
    finally:
        for f in list(logger.filters):
            logger.removeFilter(f)
    ours = [r.getMessage() for r in caplog.records if r.name == "wbrag_ray.progress"]
    ray = [r for r in caplog.records if r.name == progress.RAY_PROGRESS_LOGGER]
    assert ray == []  # none of Ray's seven lines got through
    # one line when Ray reported, none again at the end: it would say the same
    assert len(ours) == 1 and ours[0].startswith("self-rag:judge-retrieval: 120/400 rows, ")
    assert "ETA" in ours[0] and "rows/s" in ours[0]


def test_lines_come_at_most_every_interval_and_once_at_the_end(caplog):
    with caplog.at_level(logging.INFO, logger="wbrag_ray.progress"):
        with progress.running("mastery:closed_book", total=1000) as p:
            p.interval_s = 3600.0
            for _ in range(10):
                p.advance(100)
    lines = [r.getMessage() for r in caplog.records if r.name == "wbrag_ray.progress"]
    assert len(lines) == 1 and lines[0].startswith("mastery:closed_book: 1,000/1,000 rows")
    assert "ETA" not in lines[0]  # done: nothing left to wait for


def test_a_pass_waiting_for_its_first_rows_still_says_it_runs_every_interval(caplog):
    """A pass whose first batch takes long (a model loading, 40 rows in one batch on a slow CPU) prints its line
    on a timer, not only when rows come in."""
    import time

    with caplog.at_level(logging.INFO, logger="wbrag_ray.progress"):
        with progress.running("eval:answer", total=40, interval_s=0.2):
            time.sleep(0.9)
    lines = [r.getMessage() for r in caplog.records if r.name == "wbrag_ray.progress"]
    assert len(lines) >= 3, lines
    assert all(line.startswith("eval:answer: 0/40 rows, 0.0 rows/s") for line in lines), lines


def test_verbose_gives_ray_its_own_output_back():
    import ray.data

    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger(progress.RAY_PROGRESS_LOGGER)
    try:
        progress.configure(verbose=False)
        progress.configure(verbose=False)  # once per process is enough, twice does not stack filters
        assert ctx.enable_operator_progress_bars is False
        assert sum(isinstance(f, progress.RayProgressFilter) for f in logger.filters) == 1
        assert logging.getLogger("ray.data._internal.execution.streaming_executor").level == logging.WARNING
        progress.configure(verbose=True)
        assert ctx.enable_operator_progress_bars is True and not logger.filters
        assert logging.getLogger("ray.data._internal.execution.streaming_executor").level == logging.NOTSET
    finally:
        progress.configure(verbose=False)
