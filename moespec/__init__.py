"""moespec: Mixture-of-Experts inference with speculative decoding, decided from measurement."""

__version__ = "0.1.0"
