"""Words every layer of deepcompile shares and nothing else: the memory categories and byte
formatting (``memory``), the link models collectives are priced with (``links``). This package
imports nothing else of deepcompile, so any layer may import it."""
