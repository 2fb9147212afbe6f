"""Traces and metrics for every room: set-up, span helpers, metric families."""
