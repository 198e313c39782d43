"""``hybridflow report RUN_DIR [RUN_DIR ...]``: one self-contained HTML page of plots for one
run or several overlaid, with each run's config and their differences.

``runs`` reads a run directory (metrics.jsonl, config.yaml; a run still going is fine),
``plots`` draws the figures with matplotlib, ``page`` writes the HTML and the PNGs beside it,
``cli`` is the subcommand.
"""
