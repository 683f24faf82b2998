"""One callback per technique, each in its own file."""
