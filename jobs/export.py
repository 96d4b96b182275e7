"""Export the trained knowledge base to a RAG stack's own format: the base (or the base pruned at --prune-ratio)
plus the active write-back units (or --writeback V|none)
(`python jobs/export.py CONFIG --format flashrag|langchain|llamaindex --out DIR`)."""

import sys

from _job import run_job

from wbrag_ray import api
from wbrag_ray.export import FORMATS

OPTIONS = [
    (("--format",), {"required": True, "choices": FORMATS}),
    (("--out",), {"required": True, "metavar": "DIR", "help": "folder to write (local or s3://)"}),
    (("--prune-ratio",), {"type": float, "help": "Zero-RAG: the base pruned at this ratio"}),
    (("--writeback",), {"metavar": "V|active|none", "help": "write-back units (default: the active version, if any)"}),
]


def export(run, config, force, format, out, prune_ratio, writeback):
    api.export(run, config, format, out, prune_ratio=prune_ratio, writeback=writeback, force=force)


if __name__ == "__main__":
    sys.exit(run_job(__doc__, export, OPTIONS))
