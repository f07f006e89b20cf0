"""Pass-by-pass diff: what changed (diff), drawn (layout), shown in the terminal (terminal) or as a page (html)."""

from .diff import ModelDiff, Region, diff_models
from .html import render, write_report

__all__ = ["ModelDiff", "Region", "diff_models", "render", "write_report"]
