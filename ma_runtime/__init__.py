"""ma_runtime: the first program in a ModelArts-style training container."""

__version__ = "0.1.0"
