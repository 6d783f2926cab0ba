"""Sphinx configuration of FlexMig's documentation (tox -e docs)."""

project = "FlexMig"
copyright = "FlexMig developers"
extensions = [
    "myst_parser",
    # The configuration reference comes from the option definitions.
    "oslo_config.sphinxext",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
html_theme = "alabaster"
pygments_style = "sphinx"
# The guides' Markdown keeps its own heading levels.
myst_heading_anchors = 3
