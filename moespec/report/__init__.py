"""Figures and reports (matplotlib PNG, Markdown)."""
