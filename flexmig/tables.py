"""Operator-facing tables, drawn by cliff's table formatter as OpenStack's clients draw them."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from cliff.formatters.table import TableFormatter


def _formatter_args() -> argparse.Namespace:
    """The formatter's own defaults (width fitted to a terminal, no sorting)."""
    parser = argparse.ArgumentParser(add_help=False)
    TableFormatter().add_argument_group(parser)
    args = parser.parse_args([])
    args.sort_columns = False
    return args


def show_list(
    columns: Sequence[str], rows: Iterable[Sequence[Any]], stream: TextIO | None = None
) -> None:
    """A table with one row per item (``openstack server list``'s look)."""
    TableFormatter().emit_list(
        list(columns), [list(r) for r in rows], stream or sys.stdout, _formatter_args()
    )


def show_one(fields: Mapping[str, Any], stream: TextIO | None = None) -> None:
    """A Field/Value table of one item (``openstack server show``'s look)."""
    TableFormatter().emit_one(
        list(fields), list(fields.values()), stream or sys.stdout, _formatter_args()
    )
