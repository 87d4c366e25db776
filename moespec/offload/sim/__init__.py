"""The virtual back end of the layer driver: a clock, a timing model and hardware profiles."""
