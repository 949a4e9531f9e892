"""The native runtime's C++ sources, shipped as package data (``deepcompile._csrc``).

``deepcompile.runtime.build`` reads them from here and compiles them on first use.
"""
