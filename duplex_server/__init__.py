"""duplex-server: the ASGI app, the realtime protocol and the HTTP routes."""
