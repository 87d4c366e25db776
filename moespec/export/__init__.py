"""Exports of checkpoints moespec reads into other engines' formats (GGUF for llama.cpp)."""
