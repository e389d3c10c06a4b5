"""``src/evaluate.py --compare A.pth B.pth``: two checkpoints scored on the same images.

Each checkpoint sees every image of --data_dir as its training evaluated (its own size and
normalisation); the tool prints and writes (compare.json, compare.html) each top-1 with its
95% interval, the difference with McNemar's exact test and the images on which they differ.
"""

from __future__ import annotations

import argparse
import json
import logging

from imgtrainer.distributed.setup import DistInfo
from imgtrainer.errors import UserError
from imgtrainer.reports.page.compare import Comparison, build_comparison_page
from imgtrainer.reports.page.thumbnails import DataImages
from imgtrainer.tools.inference import load_classifier
from imgtrainer.tools.scoring import build_eval_folder, score

log = logging.getLogger(__name__)


def compare_and_report(args: argparse.Namespace, dist: DistInfo) -> int:
    a, b = (
        load_classifier(path, dist.device, args.weights, args.eval_resize_ratio, args.tta)
        for path in args.compare
    )
    if a.class_names != b.class_names:
        raise UserError(
            f"{args.compare[0]} and {args.compare[1]} have different classes "
            f"({len(a.class_names)} and {len(b.class_names)}, or another order): only models "
            "of the same classes can be compared image by image"
        )
    folder, _ = build_eval_folder(args.data_dir, a.class_names, args.output, dist)
    comparison = Comparison(
        score(a, folder, args, dist).predictions,
        score(b, folder, args, dist).predictions,
        (str(args.compare[0]), str(args.compare[1])),
    )
    for line in comparison.lines():
        log.info(line)
    if dist.is_main:
        args.output.mkdir(parents=True, exist_ok=True)
        summary = args.output / "compare.json"
        summary.write_text(json.dumps(comparison.summary(), indent=2) + "\n")
        images = DataImages(str(args.data_dir), a.class_names, table=folder.table)
        page = args.output / "compare.html"
        page.write_text(build_comparison_page(comparison, images))
        log.info(f"Wrote {summary}, {page}")
    return 0
