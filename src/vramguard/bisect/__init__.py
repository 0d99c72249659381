"""Finding the release that changed memory or gradients: the search, package index, overlays, child processes, and the release matrix."""
