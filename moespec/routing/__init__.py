"""Routing traces and reuse: record, store (Parquet), estimate rho(n), U(n), u(n), simulate."""

from moespec.routing.trace import RoutingTrace

__all__ = ["RoutingTrace"]
