"""Sans-I/O protocol core: typed events, codec, session state machine, wire errors."""
