"""tpkit: profile a slice of your PyTorch training loop from a notebook, see where the time,
memory and clock cycles went, change one knob, compare."""
__version__ = "0.1.0"
