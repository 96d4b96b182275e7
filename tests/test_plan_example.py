"""docs/plan-example.md is what `wbrag plan` prints: regenerate it with `python -m wbrag_ray.plan.example`."""

from wbrag_ray.plan.example import PAGE, page


def test_the_plan_example_page_is_what_wbrag_plan_prints():
    now = page()
    assert PAGE.read_text() == now, ("docs/plan-example.md differs from what `wbrag plan` prints now: run "
                                     "`python -m wbrag_ray.plan.example` and commit the page")
