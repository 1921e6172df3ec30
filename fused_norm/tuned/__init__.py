"""Measured launch choices, one generated table per GPU architecture (``sm90.py``, ...).

Each module holds ``TABLE``: ``{(direction, kind, tag, width): overrides}``, read by
``fused_norm.heuristics.tuned``. ``bench/tune.py`` writes these files: it times, on the GPU at
hand, the rules' plan of each listed row against candidate overrides and keeps an override only
where it wins by at least 3%. Do not edit them by hand; re-run the script (docs/tuning.md).
"""
