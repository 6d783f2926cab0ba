"""Sphinx configuration of FlexMig's release notes (tox -e releasenotes)."""

project = "FlexMig Release Notes"
copyright = "FlexMig developers"
extensions = ["reno.sphinxext"]
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
