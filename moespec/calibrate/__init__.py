"""Calibration: benchmark one layer's expert operation, fit bandwidths, predict, plan."""
