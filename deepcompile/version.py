"""The package version, in a module of its own: the run record and the plan cache name it
without importing the package root (which imports the whole API)."""
__version__ = "0.1.0"
