"""Object storage: URLs, one store interface with OBS and local backends, the transfer engine."""
